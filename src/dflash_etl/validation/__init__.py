"""The gates between stages: pandera contracts, great-expectations suites, `check`."""
