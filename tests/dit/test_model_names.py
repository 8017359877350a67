"""The unknown-model error lists every name that is accepted, SiT's spellings included (issue #34)."""
from __future__ import annotations

import re

import pytest

from dit_pipeline.dit.family import lookup_preset


def test_the_error_lists_sit_names_and_every_listed_name_is_accepted():
    with pytest.raises(ValueError) as e:
        lookup_preset("DiT-Q/3")
    names = re.findall(r"(?:[:,] )([A-Za-z0-9p]+-[A-Za-z0-9.-]*[A-Za-z0-9](?:/\d+)?)", str(e.value))
    assert {"SiT-XL/2", "SiT-S/8", "DiT-XL/2", "LightningDiT-XL/1", "PixArt-1.6B"} <= set(names)  # a dot in a name
    for name in names:
        lookup_preset(name)  # raises for a listed name that is not accepted
    assert lookup_preset("SiT-XL/2")[1] == "DiT-XL/2"
