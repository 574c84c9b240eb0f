"""The stage lifecycle and what every stage shares: config, run directory, accounting, errors."""
