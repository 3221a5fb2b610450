"""The worker's stored state: the one codec (records <-> bytes) and the layout in Faust's table."""
