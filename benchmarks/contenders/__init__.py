"""The peers dplaunch is measured against: scripts each rank runs under `accelerate launch`."""
