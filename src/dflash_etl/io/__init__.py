"""Reading sources and writing files in the formats other tools read."""
