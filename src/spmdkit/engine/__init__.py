"""spmdkit.engine: op-independent propagation machinery (notation, view algebra)."""
