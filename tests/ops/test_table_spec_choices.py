"""TableSpec: a pooling, optimizer or placement outside its choices is one line naming the
table, the key, the choices and the value."""

from __future__ import annotations

import re

import pytest

from recaccel.errors import ConfigError
from recaccel.ops.embedding.specs import OPTIMIZERS, PLACEMENTS, POOLINGS, TableSpec


@pytest.mark.parametrize(
    ("key", "allowed"), [("pooling", POOLINGS), ("optimizer", OPTIMIZERS), ("placement", PLACEMENTS)]
)
def test_a_choice_outside_its_list_names_table_key_choices_and_value(key, allowed):
    message = f"table 'clicks': {key} must be one of {allowed}, got 'nope'"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        TableSpec("clicks", 10, 4, **{key: "nope"})


def test_every_listed_choice_is_accepted():
    for pooling in POOLINGS:
        for optimizer in OPTIMIZERS:
            for placement in PLACEMENTS:
                spec = TableSpec("t", 3, 2, pooling=pooling, optimizer=optimizer, placement=placement)
                assert (spec.pooling, spec.optimizer, spec.placement) == (pooling, optimizer, placement)
