"""The ``health`` section and the per-checkpoint evaluation's pure parts: its settings'
errors (naming the field), the ledger that makes each checkpoint evaluated once, the two
jobs it renders, and the DAGs the factory makes of it."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from operators.campaign.dag import eval_dag
from operators.campaign.render import checkpoint_eval
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import CampaignConfigError, load_campaign
from tests.campaign.util import DEMO, LLAMA_8B, dump, edited, raw

pytestmark = pytest.mark.pure
HEALTH = Path(__file__).parents[1] / "campaigns" / "health" / "health_eval.yaml"


def _load(base: Path, changes: dict, tmp_path: Path):
    path = tmp_path / "campaign.yaml"
    path.write_text(dump(edited(raw(base), changes)))
    return load_campaign(path)


@pytest.mark.parametrize(("field", "value"), [
    ("health.evaluate_checkpoints", "sometimes"),
    ("health.eval_pool", "pool; rm -rf /"),
    ("health.loss_spike.factor", 1.0),  # not above the median: every step would be a spike
    ("health.loss_spike.factor", float("nan")),
    ("health.loss_spike.window", 1),
    ("health.loss_spike.decision_timeout_min", 0),
    ("health.loss_spike.default_action", "rollback"),
    ("health.loss_spike.typo", 1),
])
def test_health_settings_are_validated_naming_the_field(field, value, tmp_path) -> None:
    with pytest.raises(CampaignConfigError) as caught:
        _load(DEMO, {field: value}, tmp_path)
    assert field in caught.value.fields, caught.value


def test_ledger_evaluates_each_announced_checkpoint_once() -> None:
    text = eval_dag.ledger_lines([(2, eval_dag.ANNOUNCED), (4, eval_dag.ANNOUNCED)]) + \
        eval_dag.ledger_lines([(2, eval_dag.EVALUATED), (6, eval_dag.ANNOUNCED),
                               (4, eval_dag.SKIPPED)], run_id="r")
    states = eval_dag.read_ledger(text)
    assert states == {2: "evaluated", 4: "skipped", 6: "announced"}
    assert eval_dag.to_evaluate(states) == [6]


def test_a_segment_announces_the_checkpoint_it_saved_not_the_trackers_latest() -> None:
    """With pre-queueing, segment 2's job may have saved iteration 4 before segment 1's task
    ends and announces: segment 1 announces its own 2 (its result's end_iteration)."""
    def tracker() -> int:
        return 4

    assert eval_dag.announced_iteration({"end_iteration": 2}, tracker) == 2
    for result in (None, {}, {"end_iteration": None}, {"end_iteration": 0},
                   {"end_iteration": True}, {"end_iteration": "2"}):
        assert eval_dag.announced_iteration(result, tracker) == 4, result


def test_a_run_claims_its_events_checkpoints_and_a_dead_runs_never_a_live_ones() -> None:
    """Several evaluation runs at once (no max_active_runs=1: apache/airflow#56050): each
    checkpoint is claimed by one run, and one a run claimed and never evaluated is taken over
    once that run ended."""
    A, E, S = eval_dag.ANNOUNCED, eval_dag.EVALUATED, eval_dag.SKIPPED
    text = (eval_dag.ledger_lines([(2, A)], run_id="r1")
            + eval_dag.ledger_lines([(2, E)], run_id="r1")
            + eval_dag.ledger_lines([(4, A)], run_id="dead")
            + eval_dag.ledger_lines([(6, A)], run_id="busy")
            + eval_dag.ledger_lines([(8, A)], run_id="me")
            + eval_dag.ledger_lines([(10, S)], run_id="r1"))
    entries = eval_dag.read_entries(text)
    assert entries[4] == eval_dag.LedgerEntry(A, "dead")
    asked: list[str] = []

    def live(run_id: str) -> bool:
        asked.append(run_id)
        return run_id == "busy"

    # its events: 12 (new), 2 (evaluated), 6 (a live run's: a duplicate event), 10 (skipped)
    take, mine = eval_dag.claims(entries, {12, 2, 6, 10}, "me", live)
    assert take == [4, 12]  # the dead run's claim and its own new one
    assert mine == [4, 8, 12]  # and what it claimed before (a retry of pending)
    assert sorted(set(asked)) == ["busy", "dead"]  # never asked about itself or ended states
    # an entry from before claims named runs counts as nobody's: taken
    assert eval_dag.claims(eval_dag.read_entries(eval_dag.ledger_lines([(2, A)])), set(), "me",
                           live) == ([2], [2])
    # a run with no events of its own (run "busy", while "me" still runs): the dead run's only
    assert eval_dag.claims(entries, set(), "busy", lambda r: r in {"busy", "me"}) == ([4], [4, 6])


def test_the_final_evaluate_waits_for_a_run_with_the_checkpoint_never_for_a_lost_event() -> None:
    """The demo's third checkpoint event was dropped by Airflow (apache/airflow#56050) and the
    final evaluate waited its whole REUSE_WAIT_S for an evaluation nobody ran."""
    wait = eval_dag.waiting_on_eval
    assert wait(eval_dag.ANNOUNCED, announced=False, idle_polls=99)  # a run has it
    assert not wait(eval_dag.EVALUATED, announced=True, idle_polls=0)
    assert not wait(None, announced=False, idle_polls=0)  # nobody announced it
    # announced by the asset only: wait while the evaluation DAG has (or may get) a run
    assert wait(None, announced=True, idle_polls=eval_dag.IDLE_POLLS - 1)
    assert not wait(None, announced=True, idle_polls=eval_dag.IDLE_POLLS)


def test_exports_ship_the_tokenizer_the_segments_loaded(tmp_path) -> None:
    """A campaign with its own prefixes and ``data.tokenizer.path`` runs no data stage, so the
    layout's data/tokenizer stays empty: both exports (the final one and each checkpoint's)
    name the tokenizer the segments loaded. (The goodput bench's evaluated campaign failed
    every checkpoint export on "no tokenizer files" before.)"""
    from operators.campaign.render import stages
    from operators.campaign.schema.load import campaign_from_dict

    elsewhere = "/home/pretrain/shared/tokenizers/bpe-32k"
    campaign = campaign_from_dict(edited(raw(HEALTH), {"data.tokenizer": {"path": elsewhere}}))
    layout = Layout.for_campaign(campaign)
    assert layout.tokenizer != elsewhere
    checkpoint_export = checkpoint_eval.export_request(campaign, layout, [2])
    argv = shlex.split(checkpoint_export.command.splitlines()[-1])
    assert argv[argv.index("--tokenizer") + 1] == elsewhere
    argv = shlex.split(stages.export(campaign, layout)["command"].splitlines()[-1])
    assert argv[argv.index("--tokenizer") + 1] == elsewhere


def test_checkpoint_jobs_render_the_final_stages_flags_per_iteration(tmp_path) -> None:
    campaign = load_campaign(HEALTH)
    layout = Layout.for_campaign(campaign)
    export = checkpoint_eval.export_request(campaign, layout, [2, 4])
    argv = shlex.split(export.command.splitlines()[-1])
    assert argv[argv.index("--iterations") + 1:argv.index("--checkpoint-root")] == ["2", "4"]
    assert argv[argv.index("--") + 1:] == ["--tokenizer", layout.tokenizer]
    evaluate = checkpoint_eval.evaluate_request(campaign, layout, [4], "transformers")
    argv = shlex.split(evaluate.command.splitlines()[-1])
    assert argv[argv.index("--backend") + 1] == "transformers"
    assert argv[argv.index("--dataset") + 1] == campaign.data.prefixes[0]
    assert checkpoint_eval.evaluate_request(campaign, layout, [4]).command.count(
        "--backend vllm") == 1  # the campaign's final evaluate's backend by default
    assert checkpoint_eval.eval_result_path(layout, 4) == \
        f"{layout.campaign_dir}/checkpoint_evals/iter_0000004/eval.json"


def test_bridge_campaign_exports_each_checkpoint_with_bridge(tmp_path) -> None:
    campaign = _load(LLAMA_8B, {"health.evaluate_checkpoints": True}, tmp_path)
    request = checkpoint_eval.export_request(campaign, Layout.for_campaign(campaign), [250])
    assert "--bridge --hf-model meta-llama/Meta-Llama-3.1-8B" in request.command
    assert "apptainer" in request.command  # in the export stage's image, like the final one


def test_factory_makes_the_evaluation_dag_only_when_asked(tmp_path) -> None:
    from operators.campaign.dag.dag_factory import START, build_dag

    off = _load(DEMO, {"health.evaluate_checkpoints": False}, tmp_path)  # demo.yaml has it on
    dag = build_dag(off, auto_register=False)
    assert not dag.task_dict["train.segment_1"].outlets
    on = _load(DEMO, {"health.evaluate_checkpoints": True, "health.eval_pool": "pp_eval"},
               tmp_path)
    dag = build_dag(on, auto_register=False)
    asset = eval_dag.checkpoints_asset(on)
    assert dag.task_dict["train.segment_2"].outlets == [asset]
    assert isinstance(dag.task_dict["evaluate"], eval_dag.ReusingEvaluateOperator)
    # its inlet: the events say which checkpoint is announced before the ledger knows it
    assert dag.task_dict["evaluate"].inlets == [asset]
    evals = eval_dag.build_eval_dag(on, START, auto_register=False)
    assert evals.dag_id == "pretrain__demo__eval"
    assert [t.task_id for t in evals.tasks] == ["pending", "export", "evaluate"]
    assert {t.pool for t in evals.tasks} == {"pp_eval"}
    # runs at once: at max_active_runs=1 Airflow strands events (apache/airflow#56050)
    assert evals.max_active_runs == eval_dag.EVAL_MAX_ACTIVE_RUNS > 1


def test_batches_to_skip_reach_each_trainers_config_in_its_numbering(tmp_path) -> None:
    import json as _json

    import yaml

    from operators.campaign.adapters.health_state import skip_list
    from operators.campaign.dag.health import with_skips
    from operators.campaign.render import bridge, reference
    from operators.campaign.render.paths import RunInputs

    skip = {"from_iteration": 4, "batches": 2}
    assert skip_list(skip, bridge=False) == [4, 5]  # Megatron-LM: iterations done before it
    assert skip_list(skip, bridge=True) == [5, 6]  # Bridge: step + 1 in iterations_to_skip
    assert skip_list(None, bridge=True) == []
    ref = load_campaign(HEALTH)
    layout = Layout.for_campaign(ref)
    request = reference.reference_segment(ref, layout, RunInputs.stand_in(ref, layout))
    config = _json.loads(with_skips(request, [4, 5], bridge=False).files[reference.CONFIG_FILE])
    assert config["iterations_to_skip"] == [4, 5]
    big = load_campaign(LLAMA_8B)
    layout = Layout.for_campaign(big)
    request = bridge.bridge_segment(big, layout, RunInputs.stand_in(big, layout), [], None)
    tree = yaml.safe_load(with_skips(request, [5, 6], bridge=True).files[bridge.CONFIG_FILE])
    assert tree["train"]["iterations_to_skip"] == [5, 6]
    assert tree["train"]["train_iters"] == big.training.train_iters  # the rest unchanged


def test_loss_spike_settings_put_the_watcher_on_every_segment(tmp_path) -> None:
    from operators.campaign.dag.dag_factory import build_dag
    from operators.campaign.dag.health import HealthSegmentOperator

    on = _load(DEMO, {"health": {"loss_spike": {"factor": 4.0, "window": 10}}}, tmp_path)
    dag = build_dag(on, auto_register=False)
    segment = dag.task_dict["train.segment_1"]
    assert isinstance(segment, HealthSegmentOperator) and not segment.outlets
    assert on.health.loss_spike.default_action == "stop"


def test_the_decision_form_follows_the_settings_and_shows_the_spike(tmp_path) -> None:
    from datetime import timedelta

    from airflow.providers.standard.operators.hitl import HITLOperator

    from operators.campaign.dag.dag_factory import build_dag
    from operators.campaign.dag.health import decision_body

    on = _load(DEMO, {"health.loss_spike": {"factor": 4.0, "window": 10,
                                            "decision_timeout_min": 45,
                                            "default_action": "continue"}}, tmp_path)
    dag = build_dag(on, auto_register=False)
    decide = dag.task_dict["health.decide"]
    assert isinstance(decide, HITLOperator) and decide.trigger_rule == "all_done"
    assert decide.options == ["continue", "roll back", "stop"]
    assert decide.defaults == ["continue"]
    assert decide.response_timeout == timedelta(minutes=45)
    assert set(decide.params) == {"checkpoint", "skip_batches"}
    assert dag.task_dict["health.apply"].upstream_task_ids == {"health.decide"}
    assert dag.task_dict["health.resume"].trigger_dag_id == dag.dag_id
    assert "health.decide" not in build_dag(load_campaign(DEMO), auto_register=False).task_dict
    body = decision_body({"reason": "loss spike at iteration 4: ...", "iteration": 4,
                          "losses": [[3, 5.1], [4, 40.2]], "checkpoints": [2, 4],
                          "segment": 2, "run_id": "r"})
    assert "| 4 | 40.2 | <- flagged" in body and "before the finding: [2]" in body


def test_compare_draws_a_bits_per_byte_panel_once_there_is_a_curve() -> None:
    from operators import compare

    one = compare.Campaign("a", "r1", "FINISHED", curves={
        "lm_loss": [(100.0, 5.0), (200.0, 4.0)], compare.BPB_CURVE: [(200.0, 2.5)]})
    assert len(compare.plot([one]).axes) == 2  # a lone final evaluation: the table's
    two = compare.Campaign("b", "r2", "FINISHED", curves={
        "lm_loss": [(100.0, 5.0)], compare.BPB_CURVE: [(100.0, 3.0), (200.0, 2.5)]})
    figure = compare.plot([one, two])
    assert len(figure.axes) == 3
    a, b = figure.axes[2].lines  # a's one evaluation is a marker on the same panel
    assert (a.get_label(), list(a.get_xdata())) == ("a", [200.0])
    assert (b.get_label(), list(b.get_xdata())) == ("b", [100.0, 200.0])
    assert figure.axes[2].get_ylabel() == "bits per byte"


def test_set_aside_checkpoints_are_kept_until_past_the_spike_and_every_one_set_aside() -> None:
    from operators.campaign.adapters.health_state import kept_until, passed

    # spike at 5, rolled back to 2 with 4 and 6 set aside: a new checkpoint 6 is not enough
    until = kept_until(2, 5, [4, 6])
    assert until == 6
    assert not passed({"until": until}, 6) and passed({"until": until}, 8)
    # spike at 9 past every checkpoint set aside (saved on SIGTERM before it): past 9
    assert kept_until(4, 9, [6, 8]) == 9
    assert kept_until(4, None, []) == 4  # nothing set aside: nothing to wait for


def test_compare_draws_the_reference_bits_per_byte_curve_where_given(tmp_path) -> None:
    from operators import compare

    path = tmp_path / "reference.csv"
    path.write_text("tokens,val_loss,bits_per_byte\n0,11.0,\n100,4.0,1.9\n200,3.5,1.4\n")
    curves = compare.read_reference_curves(path)
    assert curves == {"val_loss": [(0.0, 11.0), (100.0, 4.0), (200.0, 3.5)],
                      "bits_per_byte": [(100.0, 1.9), (200.0, 1.4)]}
    assert compare.read_reference(path) == curves["val_loss"]
    one = compare.Campaign("a", "r1", "FINISHED", curves={
        "lm_loss": [(100.0, 5.0)], compare.BPB_CURVE: [(200.0, 2.5)]})
    figure = compare.plot([one], curves["val_loss"], "llm.c",
                          reference_bpb=curves["bits_per_byte"])
    assert len(figure.axes) == 3  # the reference alone opens the panel
    (a, ref) = figure.axes[2].lines
    assert a.get_label() == "a"
    assert (ref.get_label(), ref.get_linestyle(), list(ref.get_ydata())) == (
        "llm.c", "--", [1.9, 1.4])
    bpb_only = tmp_path / "bpb.csv"
    bpb_only.write_text("tokens,bits_per_byte\n100,1.9\n")
    assert compare.read_reference(bpb_only) == []
    bad = tmp_path / "bad.csv"
    bad.write_text("tokens,bits_per_byte\n100,1.9\n200,low\n")
    with pytest.raises(SystemExit, match=r"bad.csv:3: bits_per_byte: "):
        compare.read_reference_curves(bad)
    with pytest.raises(SystemExit, match="needs columns tokens and val_loss and/or"):
        (tmp_path / "none.csv").write_text("tokens,loss\n1,2\n")
        compare.read_reference_curves(tmp_path / "none.csv")
