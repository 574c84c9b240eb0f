"""Chat-template probing and verified loss masks: the pure core of the tokenize stage."""

from dflash_etl.templates.masks import (
    FILTER_CODES,
    QUARANTINE_CODES,
    MaskPolicy,
    MaskRefused,
    TemplateTimingOut,
    TokenizedRow,
    tokenize_conversation,
    tokenize_conversations,
    verify_row,
)
from dflash_etl.templates.probe import probe_template
from dflash_etl.templates.probe_record import TemplateProbe
from dflash_etl.templates.probes import TemplateUnusable

__all__ = [
    "FILTER_CODES",
    "QUARANTINE_CODES",
    "MaskPolicy",
    "MaskRefused",
    "TemplateProbe",
    "TemplateTimingOut",
    "TemplateUnusable",
    "TokenizedRow",
    "probe_template",
    "tokenize_conversation",
    "tokenize_conversations",
    "verify_row",
]
