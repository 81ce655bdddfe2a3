"""The docs cannot drift from the code: the generated configuration reference, the site build, the
claims of what is refused, and every command README and docs/ show."""

import copy

import pytest
import yaml

from conftest import ROOT
from test_scripts import load_script
from vlgrpo import config

reference = load_script("config_reference")


def test_configuration_reference_is_what_the_script_writes():
    page = reference.render(config.load_schema())
    assert (ROOT / "docs" / "configuration.md").read_text() == page, \
        "docs/configuration.md is stale: run `python scripts/config_reference.py` and commit the page"
    for key, _ in reference.walk(config.load_schema()):  # every key of the schema has its row or section
        assert f"`{key}`" in page


def test_every_schema_key_has_a_description():
    schema = config.load_schema()
    assert reference.undescribed(schema) == []
    broken = copy.deepcopy(schema)
    del broken["properties"]["trainer"]["properties"]["save_freq"]["description"]
    with pytest.raises(reference.MissingDescription, match=r"trainer\.save_freq"):
        reference.render(broken)
    assert reference.main(["--check"]) == 0
