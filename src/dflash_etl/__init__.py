"""dflash_etl: validation-first ETL for speculative-decoding drafter training data."""

__version__ = "0.1.0"
