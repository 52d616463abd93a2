"""The demo's arithmetic prompt files keep the generic format's field names (data/prompt_record.py),
which arithmetic_data.py spells out because data/ imports it."""

from async_grpo.data.prompt_record import ANSWER_FIELD, PROMPT_TEXT_FIELD
from async_grpo.demo_assets import arithmetic_data


def test_arithmetic_records_use_the_generic_formats_fields() -> None:
    assert (arithmetic_data.PROMPT_TEXT_FIELD, arithmetic_data.ANSWER_FIELD) == (PROMPT_TEXT_FIELD, ANSWER_FIELD)
