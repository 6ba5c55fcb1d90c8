"""The reference trainer's run config loads the tokenizer the campaign names, as the Bridge
path does (render/paths.py ``tokenizer_dir``): a campaign with its own prefixes and
``data.tokenizer.path`` has no data stage that copies the tokenizer into its directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from operators.campaign.render import reference
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.schema.load import campaign_from_dict
from tests.campaign.util import DELETE, edited, raw

pytestmark = pytest.mark.pure

CI_CAMPAIGN = Path(__file__).parents[1] / "campaigns" / "ci_campaign.yaml"


def _config(changes: dict, inputs: RunInputs | None = None) -> tuple[dict, Layout]:
    campaign = campaign_from_dict(edited(raw(CI_CAMPAIGN), changes))
    layout = Layout.for_campaign(campaign)
    request = reference.reference_segment(campaign, layout,
                                          inputs or RunInputs.stand_in(campaign, layout))
    return json.loads(request.files[reference.CONFIG_FILE]), layout


def test_a_given_tokenizer_path_is_what_the_trainer_loads() -> None:
    config, layout = _config({"data.tokenizer": {"path": "/shared/tokenizers/bpe32k"},
                              "data.source": DELETE,
                              "data.prefixes": ["/shared/tokens/web_text_document"]})
    assert config["tokenizer_model"] == "/shared/tokenizers/bpe32k"
    assert config["tokenizer_model"] != layout.tokenizer
    assert config["data_path"] == ["/shared/tokens/web_text_document"]


def test_a_trained_tokenizer_is_loaded_where_the_data_stage_saved_it() -> None:
    config, layout = _config({})
    assert config["tokenizer_model"] == layout.tokenizer
    config, _ = _config({}, RunInputs.of(["/x/p_text_document"]))  # no tokenizer_dir passed
    assert config["tokenizer_model"] == layout.tokenizer
