"""Pure, torch-free planning: devices, mesh, batch math, validation."""
