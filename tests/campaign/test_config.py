"""The campaign schema: the two examples load, the 8B reference config is held value by
value, and every kind of bad input is refused with an error naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from operators.campaign.render.summary import reference_params, summary
from operators.campaign.schema.fields import slurm_minutes
from operators.campaign.schema.load import CampaignConfigError, campaign_from_dict, load_campaign
from tests.campaign.util import DELETE, DEMO, LLAMA_8B, dump, edited, raw

# The reference workflow (docs/campaign.md) as the 8B campaign: every value, defaults included.
LLAMA_8B_EXPECTED = {
    "name": "llama31_8b_fp8",
    "description": "Llama 3.1 8B, FP8 (bf16 with FP8 current scaling), 2 nodes x 4 GH200, "
                   "FineWeb sample.",
    "schedule": None,
    "cluster": {
        "ssh_conn_id": "isambard", "partition": "workq", "account": None, "qos": None,
        "nodes": 2, "gpus_per_node": 4, "cpus_per_task": 288, "mem": None,
        "time_limit": "04:00:00", "exclusive": True,
        "setup": ["module load brics/nccl", "module load brics/apptainer-multi-node"],
        "container": {"image": "/scratch/pretrain/containers/nemo_26.04.sif",
                      "binds": ["/scratch/pretrain", "/projects/pretrain/hf_home:/hf_home"],
                      "entrypoint": "/host/adapt.sh", "environment": {"HF_HOME": "/hf_home"}},
        "environment": {"NCCL_DEBUG": "WARN"},
        "remote_root": "/scratch/pretrain/campaigns",
    },
    "data": {
        "source": "hf://datasets/HuggingFaceFW/fineweb/sample/10BT/000_00000.parquet",
        "manifest": None, "prefixes": None, "blend": None, "split": "969,30,1",
        "min_doc_chars": 200, "max_doc_chars": 100000, "dedup": True,
        "gate": {"sample_size": 1000, "max_duplicate_rate": 0.05,
                 "max_replacement_char_share": 0.001, "max_nonprintable_share": 0.001},
        "tokenizer": {"path": "/scratch/pretrain/tokenizers/Meta-Llama-3.1-8B", "train": None},
        "tokenize_workers": 32,
        "array_tasks": 1,
    },
    "model": {"recipe": "llama31_8b", "reference": None, "hf_model": None},
    "training": {
        "train_iters": 1000, "global_batch_size": 128, "micro_batch_size": 1,
        "seq_length": 8192, "lr": 3e-4, "min_lr": 3e-5, "lr_warmup_iters": 100,
        "lr_decay_style": "cosine", "lr_decay_iters": None, "lr_wsd_decay_iters": None,
        "weight_decay": 0.1, "clip_grad": 1.0, "precision": "fp8",
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "context_parallel_size": 2,
        "recompute": "none", "seed": 1234,
    },
    "checkpoint": {"save_interval": 250, "keep_last": 3, "keep_every": 500, "dir": None},
    "validation": {"eval_interval": 100, "eval_iters": 10},
    "logging": {"log_interval": 10},
    "tracking": {"enabled": True, "mlflow_conn_id": "mlflow_default",
                 "experiment": "llama31_8b_fp8"},
    "retries": {"data": {"retries": 2, "retry_delay": 120, "exponential_backoff": True},
                "train": {"retries": 3, "retry_delay": 300, "exponential_backoff": True},
                "export": {"retries": 1, "retry_delay": 300, "exponential_backoff": True}},
    "segments": {"max_per_run": 6, "iters_per_segment": None, "hang_timeout_min": "auto",
                 "startup_estimate_min": 3.0,
                 "save_estimate_s": 120.0, "margin_min": 5.0, "prequeue_depth": 1},
    "health": {"evaluate_checkpoints": False, "eval_pool": None, "loss_spike": None},
    "stages": {name: {"image": None, "partition": None, "gpus_per_node": None,
                      "cpus_per_task": None, "mem": None, "time_limit": None}
               for name in ("data", "preflight", "export", "evaluate")}
    | {"evaluate": {"image": "/scratch/pretrain/containers/vllm.sif", "partition": None,
                    "gpus_per_node": None, "cpus_per_task": None, "mem": None,
                    "time_limit": None},
       "data": {"image": None, "partition": None, "gpus_per_node": None, "cpus_per_task": 8,
                "mem": None, "time_limit": None}},
}


def test_llama31_8b_fp8_holds_the_reference_workflow() -> None:
    campaign = load_campaign(LLAMA_8B)
    assert campaign.model_dump() == LLAMA_8B_EXPECTED
    assert campaign.model.recipe_function == "llama31_8b_pretrain_config"
    assert (campaign.world_size, campaign.data_parallel_size) == (8, 4)
    assert campaign.cluster.time_limit_minutes == 240


def test_demo_loads() -> None:
    campaign = load_campaign(DEMO)
    assert campaign.model.reference is not None and campaign.data.source == "demo"
    assert campaign.data.tokenizer.train.vocab_size == 2048
    assert campaign.world_size == 1 and campaign.cluster.container is None


def _problems(doc, tmp_path: Path) -> CampaignConfigError:
    path = tmp_path / "campaign.yaml"
    path.write_text(doc if isinstance(doc, str) else dump(doc))
    with pytest.raises(CampaignConfigError) as caught:
        load_campaign(path)
    assert str(path) in str(caught.value)  # every message names the file
    return caught.value


def _assert_rejects(base: Path, changes: dict, field: str, fragment: str, tmp_path: Path):
    error = _problems(edited(raw(base), changes), tmp_path)
    assert field in error.fields, f"{field} not in {error.fields}: {error}"
    assert fragment.lower() in str(error).lower(), str(error)


# --- every string that reaches a script --------------------------------------------------------
_CONTAINER = {"cluster.container": {"image": "/img/nemo.sif", "binds": ["/scratch"]}}
_NO_SOURCE = {"data.source": DELETE}
SCRIPT_STRINGS = [
    # (field as reported, changes that put the payload there)
    ("name", lambda v: {"name": v}),
    ("cluster.ssh_conn_id", lambda v: {"cluster.ssh_conn_id": v}),
    ("cluster.partition", lambda v: {"cluster.partition": v}),
    ("cluster.account", lambda v: {"cluster.account": v}),
    ("cluster.qos", lambda v: {"cluster.qos": v}),
    ("cluster.mem", lambda v: {"cluster.mem": v}),
    ("cluster.time_limit", lambda v: {"cluster.time_limit": v}),
    ("cluster.container.image", lambda v: {"cluster.container": {"image": v}}),
    ("cluster.container.binds[0]", lambda v: {"cluster.container": {"image": "/i.sif",
                                                                    "binds": [v]}}),
    ("cluster.environment.NCCL_DEBUG", lambda v: {"cluster.environment": {"NCCL_DEBUG": v}}),
    ("cluster.remote_root", lambda v: {"cluster.remote_root": v}),
    ("data.source", lambda v: {"data.source": v}),
    ("data.manifest", lambda v: {**_NO_SOURCE, "data.manifest": v}),
    ("data.prefixes[0]", lambda v: {**_NO_SOURCE, "data.prefixes": [v]}),
    ("data.blend[0].prefix", lambda v: {**_NO_SOURCE, "data.blend": [{"weight": 1,
                                                                      "prefix": v}]}),
    ("data.split", lambda v: {"data.split": v}),
    ("data.tokenizer.path", lambda v: {"data.tokenizer": {"path": v}}),
    ("model.recipe", lambda v: {"model": {"recipe": v}, **_CONTAINER}),
    ("checkpoint.dir", lambda v: {"checkpoint.dir": v}),
    ("tracking.mlflow_conn_id", lambda v: {"tracking.mlflow_conn_id": v}),
    ("tracking.experiment", lambda v: {"tracking.experiment": v}),
    ("schedule", lambda v: {"schedule": v}),
]
PAYLOADS = ["/ok\nrm -rf /", "/ok;rm -rf /", "/ok$(id)", "/ok`id`", "/ok | tee", "/ok\x00",
            "/ok && id", "/ok > /etc/passwd"]


@pytest.mark.parametrize("payload", PAYLOADS, ids=repr)
@pytest.mark.parametrize(("field", "changes"), SCRIPT_STRINGS, ids=[f for f, _ in SCRIPT_STRINGS])
def test_script_strings_refuse_newlines_and_metacharacters(field, changes, payload, tmp_path):
    error = _problems(edited(raw(DEMO), changes(payload)), tmp_path)
    assert field in error.fields, f"{field} not in {error.fields}: {error}"


@pytest.mark.parametrize(("field", "changes"), [
    ("cluster.remote_root", {"cluster.remote_root": "/home/../etc"}),
    ("checkpoint.dir", {"checkpoint.dir": "/scratch/../../etc"}),
    ("cluster.container.binds[0]", {"cluster.container": {"image": "/i.sif",
                                                          "binds": ["/scratch/..:/x"]}}),
    ("data.prefixes[0]", {**_NO_SOURCE, "data.prefixes": ["../other/data_text_document"]}),
    ("data.manifest", {**_NO_SOURCE, "data.manifest": "data/../../manifest.json"}),
    ("data.source", {"data.source": "../corpus/*.parquet"}),
    ("data.tokenizer.path", {"data.tokenizer": {"path": "tok/.."}}),
])
def test_path_traversal_is_refused(field, changes, tmp_path) -> None:
    _assert_rejects(DEMO, changes, field, "'..'", tmp_path)


@pytest.mark.parametrize("key", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                                 "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "ssh_key",
                                 "GITHUB_PAT", "MY_SECRETS", "GOOGLE_APPLICATION_CREDENTIALS"])
def test_secret_looking_environment_keys_are_refused(key, tmp_path) -> None:
    _assert_rejects(DEMO, {"cluster.environment": {key: "x"}}, f"cluster.environment.{key}",
                    "looks like a secret", tmp_path)


def test_ordinary_environment_keys_pass() -> None:
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HOME": "/hf", "NCCL_SOCKET_IFNAME": "^lo,docker",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": "4"}
    campaign = campaign_from_dict(edited(raw(DEMO), {"cluster.environment": env}))
    assert campaign.cluster.environment == env


@pytest.mark.parametrize(("field", "value"), [
    ("cluster.nodes", 0), ("cluster.gpus_per_node", -1), ("cluster.cpus_per_task", 0),
    ("training.train_iters", 0), ("training.global_batch_size", -8),
    ("training.micro_batch_size", 0), ("training.seq_length", 0), ("training.lr", 0),
    ("training.lr", -1e-3), ("training.min_lr", -1.0), ("checkpoint.save_interval", 0),
    ("checkpoint.keep_last", 0), ("validation.eval_iters", 0), ("logging.log_interval", 0),
    ("data.tokenize_workers", 0), ("data.tokenizer.train.vocab_size", 0),
    ("model.reference.hidden_size", 0), ("model.reference.num_layers", -2),
    ("retries.train.retries", -1), ("retries.train.retry_delay", 0),
    ("segments.max_per_run", 0), ("data.gate.max_duplicate_rate", 1.5),
    ("segments.margin_min", 1),
])
def test_sizes_must_be_positive(field, value, tmp_path) -> None:
    error = _problems(edited(raw(DEMO), {field: value}), tmp_path)
    assert field in error.fields, str(error)


@pytest.mark.parametrize(("field", "value"), [
    ("training.train_iters", "many"), ("cluster.nodes", 2.5), ("cluster.nodes", True),
    ("training.lr", "fast"), ("training.lr", True), ("cluster.exclusive", "maybe"),
    ("cluster.environment.OMP_NUM_THREADS", 4), ("cluster.account", 1234),
    ("data.prefixes", "/one/prefix"), ("training.lr_decay_style", "exponential"),
    ("training.precision", "fp16"), ("training.recompute", "some"),
])
def test_wrong_types_are_refused(field, value, tmp_path) -> None:
    changes = {field: value, **(_NO_SOURCE if field.startswith("data.prefixes") else {})}
    error = _problems(edited(raw(DEMO), changes), tmp_path)
    assert field in error.fields, str(error)


@pytest.mark.parametrize(("changes", "field", "suggestion"), [
    ({"training.lr_warmup_iter": 5}, "training.lr_warmup_iter", "lr_warmup_iters"),
    ({"trainig": {}}, "trainig", "training"),
    ({"cluster.container": {"image": "/i.sif", "bind": ["/x"]}}, "cluster.container.bind",
     "binds"),
    ({"data.gate.sample": 5}, "data.gate.sample", "sample_size"),
    ({**_NO_SOURCE, "data.blend": [{"weight": 1, "prefix": "/p", "wieght": 2}]},
     "data.blend[0].wieght", "weight"),
])
def test_unknown_keys_name_their_path_and_a_suggestion(changes, field, suggestion, tmp_path):
    error = _problems(edited(raw(DEMO), changes), tmp_path)
    assert field in error.fields
    assert f"did you mean {suggestion!r}" in str(error)


@pytest.mark.parametrize(("base", "changes", "field", "fragment"), [
    (LLAMA_8B, {"training.global_batch_size": 130}, "training.global_batch_size",
     "micro_batch_size x data-parallel size = 1 x 4"),
    (LLAMA_8B, {"training.micro_batch_size": 3}, "training.global_batch_size", "= 3 x 4"),
    (LLAMA_8B, {"training.tensor_parallel_size": 3}, "training.tensor_parallel_size",
     "must divide the world size"),
    (LLAMA_8B, {"training.seq_length": 262144}, "training.seq_length", "exceeds"),
    (LLAMA_8B, {"cluster.container": DELETE}, "cluster.container", "NeMo container"),
    (LLAMA_8B, {"cluster.gpus_per_node": 0}, "cluster.gpus_per_node", "GPUs"),
    (DEMO, {"training.min_lr": 0.01}, "training.min_lr", "exceeds lr"),
    (DEMO, {"training.lr_warmup_iters": 60}, "training.lr_warmup_iters", "below train_iters"),
    (DEMO, {"training.lr_decay_iters": 5}, "training.lr_decay_iters", "exceed"),
    (DEMO, {"checkpoint.keep_every": 12}, "checkpoint.keep_every", "multiple of save_interval"),
    (DEMO, {"training.precision": "fp8"}, "training.precision", "GPUs"),
    (DEMO, {"training.lr_decay_style": "WSD"}, "training.lr_wsd_decay_iters", "WSD"),
    (DEMO, {"training.context_parallel_size": 2}, "training.tensor_parallel_size", "unsplit"),
    (DEMO, {"cluster.remote_root": DELETE}, "cluster.remote_root", "checkpoint.dir"),
    (DEMO, {"cluster.time_limit": "3"}, "cluster.time_limit", "no training time"),
    (DEMO, {"data.prefixes": ["/p"]}, "data", "exactly one of source, manifest"),
    (DEMO, {"data.tokenizer.path": "/tok"}, "data.tokenizer", "exactly one of path, train"),
    (DEMO, {"model.recipe": "llama31_8b"}, "model", "exactly one of recipe, reference"),
    (DEMO, {"data.min_doc_chars": 200000}, "data", "min_doc_chars"),
    (DEMO, {"model.reference.num_key_value_heads": 3}, "model.reference", "num_key_value_heads"),
])
def test_cross_field_rules_name_the_field(base, changes, field, fragment, tmp_path) -> None:
    _assert_rejects(base, changes, field, fragment, tmp_path)


def test_cross_field_errors_carry_their_line(tmp_path) -> None:
    error = _problems(edited(raw(DEMO), {"training.global_batch_size": 6}), tmp_path)
    (problem,) = error.problems
    text = (tmp_path / "campaign.yaml").read_text().splitlines()
    assert text[problem.line - 1].strip().startswith("global_batch_size:")


def test_all_problems_come_in_one_error(tmp_path) -> None:
    error = _problems(edited(raw(DEMO), {"cluster.nodes": 0, "training.lr": "x",
                                         "logging.oops": 1}), tmp_path)
    assert {"cluster.nodes", "training.lr", "logging.oops"} <= set(error.fields)
    assert str(error).count("campaign.yaml:") == len(error.problems)


def test_yaml_syntax_error_names_the_line(tmp_path) -> None:
    text = DEMO.read_text().replace("  dedup: true", "  dedup: [true")
    error = _problems(text, tmp_path)
    (problem,) = error.problems
    assert problem.line is not None and f"campaign.yaml:{problem.line}: YAML syntax" in str(error)


def test_duplicate_keys_are_refused_with_both_lines(tmp_path) -> None:
    text = DEMO.read_text().replace("  seed: 1234", "  seed: 1234\n  seed: 7")
    error = _problems(text, tmp_path)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s == "  seed: 7")
    assert error.problems[0].line == line and f"first on line {line - 1}" in str(error)


def test_unquoted_base_60_time_gets_a_hint(tmp_path) -> None:
    text = DEMO.read_text().replace('time_limit: "5"', "time_limit: 4:00:00")
    assert "quote Slurm times" in str(_problems(text, tmp_path))


def test_short_float_notation_is_a_number(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(DEMO.read_text().replace("lr: 1.0e-3", "lr: 1e-3"))
    assert load_campaign(path).training.lr == pytest.approx(1e-3)


def test_not_a_mapping_and_missing_file(tmp_path) -> None:
    assert "mapping" in str(_problems("- just\n- a list\n", tmp_path))
    with pytest.raises(CampaignConfigError, match="cannot read"):
        load_campaign(tmp_path / "absent.yaml")


def test_campaign_from_dict_without_a_file() -> None:
    with pytest.raises(CampaignConfigError, match=r"<campaign>: name"):
        campaign_from_dict({**raw(DEMO), "name": "../evil"})


@pytest.mark.parametrize(("value", "minutes"), [
    ("30", 30), ("90:30", 91), ("04:00:00", 240), ("1-00:00:00", 1440), ("2-12", 3600),
    ("1-01:30", 1530), ("0:59", 1),
])
def test_slurm_time_to_minutes(value, minutes) -> None:
    assert slurm_minutes(value) == minutes


@pytest.mark.parametrize("value", ["", "0", "00:00:00", "4h", "1-", "-5", "1:2:3:4"])
def test_bad_slurm_times(value) -> None:
    with pytest.raises(ValueError):
        slurm_minutes(value)


@pytest.mark.parametrize("schedule", [None, "@daily", "@weekly", "0 3 * * *", "*/15 * * * 1-5",
                                      "0 0 1 JAN,JUL *", "30 2 * * SUN"])
def test_valid_schedules(schedule) -> None:
    assert campaign_from_dict({**raw(DEMO), "schedule": schedule}).schedule == schedule


@pytest.mark.parametrize("schedule", ["@sometimes", "61 * * * *", "* * * *", "0 24 * * *",
                                      "*/0 * * * *", "5-1 * * * *", "0 0 32 * *", "0 0 * 13 *"])
def test_invalid_schedules(schedule, tmp_path) -> None:
    error = _problems(edited(raw(DEMO), {"schedule": schedule}), tmp_path)
    assert error.fields == ["schedule"]


def test_summary_figures() -> None:
    demo = load_campaign(DEMO)
    # 354,624 is what transformers' LlamaForCausalLM reports for this config (vocab 2048).
    assert reference_params(demo.model.reference, 2048) == (354_624, True)
    text = summary(demo, dataset_tokens=61_440 * 4)
    assert "61.4 k" in text and "0.25 over" in text and "Chinchilla ~20" in text
    big = summary(load_campaign(LLAMA_8B))
    assert "1.05 B" in big and "8.03 B parameters" in big and "unknown until" in big
    assert "0.131 (Chinchilla ~20: 1%)" in big
