"""Config -> params: dotted keys, MLflow's limits, secrets redacted; Slurm accounting."""

from __future__ import annotations

from datetime import datetime

from operators.slurm.parse import JobRecord
from operators.tracking import limits, params


def test_flatten_nested_config():
    flat = params.flatten({
        "training": {"lr": 3e-4, "seq_length": 4096, "fp8": True, "min_lr": None},
        "data": {"blend": [{"prefix": "/d/a", "weight": 0.7}, {"prefix": "/d/b", "weight": 0.3}],
                 "gates": [], "extra": {}},
        "name": "demo",
    })
    assert flat == {
        "training.lr": "0.0003", "training.seq_length": "4096", "training.fp8": "true",
        "training.min_lr": "null", "data.blend.0.prefix": "/d/a", "data.blend.0.weight": "0.7",
        "data.blend.1.prefix": "/d/b", "data.blend.1.weight": "0.3", "data.gates": "[]",
        "data.extra": "{}", "name": "demo",
    }


def test_flatten_reads_pydantic_models():
    from pydantic import BaseModel

    class Inner(BaseModel):
        lr: float = 0.1

    class Outer(BaseModel):
        training: Inner = Inner()

    assert params.flatten(Outer()) == {"training.lr": "0.1"}


def test_secrets_redacted_by_key_and_by_value():
    config = {"cluster": {"environment": {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "w",
                                          "NCCL_DEBUG": "INFO", "NOTE": "key=S3SECRET!"}},
              "db_password": "p", "auth_header": "Bearer x",
              "data": {"tokenizer": {"type": "bpe"}, "num_tokens": 5}}
    out = params.config_params(config, secrets=["S3SECRET"])
    assert out["cluster.environment.HF_TOKEN"] == params.REDACTED
    assert out["cluster.environment.WANDB_API_KEY"] == params.REDACTED
    assert out["cluster.environment.NOTE"] == params.REDACTED  # holds a known secret
    assert out["db_password"] == out["auth_header"] == params.REDACTED
    assert out["cluster.environment.NCCL_DEBUG"] == "INFO"
    assert out["data.tokenizer.type"] == "bpe" and out["data.num_tokens"] == "5"  # not secrets


def test_values_and_keys_clipped_to_mlflow_limits():
    out = params.config_params({"long": "x" * 7000, "a[0]": "v", "bad?key": "v",
                                "k" * 300: "v", "a/../b": "v"})
    assert len(out["long"]) == limits.MAX_PARAM_VAL_LENGTH
    assert out["long"].endswith(limits.TRUNCATED)
    assert {"a_0_", "bad_key", "k" * 250, "a/_/b"} <= set(out)
    assert len(params.clean_tags({"t": "y" * 9000})["t"]) == limits.MAX_TAG_VAL_LENGTH


def test_limits_match_mlflow():
    from mlflow.utils import validation

    for name in ("MAX_METRICS_PER_BATCH", "MAX_PARAMS_TAGS_PER_BATCH", "MAX_ENTITIES_PER_BATCH",
                 "MAX_PARAM_VAL_LENGTH", "MAX_TAG_VAL_LENGTH", "MAX_ENTITY_KEY_LENGTH"):
        assert getattr(limits, name) == getattr(validation, name), name
    for key in ("a_0_", "x/y.z-w :v", limits.clip_key("a//b/./c/")):
        assert validation.validate_param_and_metric_name(key)
        assert not validation.path_not_unique(key)


def test_accounting():
    job = JobRecord(job_id="4242", name="k", state="TIMEOUT", exit_code=0, gpus=8,
                    submit=datetime(2025, 1, 1, 10, 0, 0), start=datetime(2025, 1, 1, 10, 5, 0),
                    end=datetime(2025, 1, 1, 12, 5, 0), elapsed_s=7200, nodelist="gpu[01-02]")
    tags, metrics = params.accounting(job)
    assert tags == {params.SLURM_JOB_ID: "4242", params.SLURM_STATE: "TIMEOUT",
                    params.SLURM_NODELIST: "gpu[01-02]", params.SLURM_GPUS: "8",
                    params.SLURM_EXIT_CODE: "0"}
    assert metrics == {params.QUEUE_WAIT_S: 300.0, params.ELAPSED_S: 7200.0,
                       params.GPU_HOURS: 16.0}
