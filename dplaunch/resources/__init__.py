"""Files shipped with dplaunch: the embedded default run file and its dataset."""
