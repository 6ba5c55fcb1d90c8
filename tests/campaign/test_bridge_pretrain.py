"""jobscripts.bridge_pretrain without Megatron Bridge: recipe lookup, the unknown-key check
over stand-in ConfigContainer dataclasses, CLI overrides, preflight, and segment.json."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobscripts import bridge_pretrain as bp
from jobscripts.bridge_result import COMPLETED, FAILED, SIGNAL, TIME_LIMIT, SegmentRecorder
from jobscripts.checkpoints import write_tracker

REPO = Path(__file__).resolve().parents[2]


# Stand-ins shaped like Bridge's ConfigContainer (training/config.py at 26.04-alpha.rc2).
@dataclass
class FakeTrain:
    train_iters: int = 300000
    global_batch_size: int = 32
    exit_duration_in_mins: int | None = None


@dataclass
class FakeDataset:
    sequence_length: int = 4096
    data_path: list | None = None

    @property
    def seq_length(self):  # Bridge's alias, applied with setattr
        return self.sequence_length

    @seq_length.setter
    def seq_length(self, value):
        self.sequence_length = value

    @property
    def read_only(self):
        return 1


@dataclass
class FakeScheduler:
    lr_warmup_iters: int = 500
    lr_decay_style: str = "cosine"


@dataclass
class FakeContainer:
    train: FakeTrain = field(default_factory=FakeTrain)
    dataset: FakeDataset = field(default_factory=FakeDataset)
    scheduler: FakeScheduler = field(default_factory=FakeScheduler)
    mixed_precision: object = "bf16_mixed"
    comm_overlap: object = None
    tags: dict = field(default_factory=dict)


def _check(tree: dict) -> list[str]:
    return bp.unknown_keys(tree, FakeContainer(), bp.dataclass_fields)


def test_recipe_by_name() -> None:
    assert bp.recipe_function_name("llama31_8b") == "llama31_8b_pretrain_config"
    assert bp.recipe_module("llama31_8b") == "megatron.bridge.recipes.llama"
    assert bp.recipe_module("qwen3_8b") == "megatron.bridge.recipes.qwen"
    assert bp.recipe_module("gpt_oss_20b") == "megatron.bridge.recipes.gpt_oss"
    assert bp.recipe_module("mystery_1b") == "megatron.bridge.recipes"
    for bad in ("", "8b", "llama;rm", "../x"):
        with pytest.raises(ValueError):
            bp.recipe_function_name(bad)


def test_known_keys_pass() -> None:
    assert _check({"train": {"train_iters": 5, "exit_duration_in_mins": 10},
                   "dataset": {"seq_length": 8192, "data_path": ["/d"]},
                   "mixed_precision": "bf16_with_fp8_current_scaling_mixed",
                   "tags": {"anything": "goes"},
                   "comm_overlap": {"_target_": "x.y.Z", "tp_comm_overlap": True}}) == []


@pytest.mark.parametrize(("tree", "expected"), [
    ({"trian": {}}, "trian: unknown key (did you mean 'train'?)"),
    ({"scheduler": {"lr_warmup_iter": 5}},
     "scheduler.lr_warmup_iter: unknown key (did you mean 'lr_warmup_iters'?)"),
    ({"train": {"exit_duration_in_min": 5}}, "train.exit_duration_in_min: unknown key"),
    ({"dataset": {"read_only": 1}}, "dataset.read_only: unknown key"),  # no setter
    ({"model": {"fp8": "hybrid"}}, "model: unknown key"),
    ({"comm_overlap": {"tp_comm_overlap": True}}, "comm_overlap: the recipe leaves this"),
    ({"scheduler": {"lr_decay_style": {"a": 1}}}, "scheduler.lr_decay_style: is a value"),
])
def test_unknown_keys_are_refused_with_their_path(tree, expected) -> None:
    problems = _check(tree)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_every_problem_is_reported() -> None:
    assert len(_check({"a": 1, "train": {"b": 2, "c": 3}})) == 3


def test_cli_overrides() -> None:
    tree = bp.cli_tree(["train.train_iters=10", "++scheduler.lr_warmup_iters=3",
                        "dataset.data_path=[/a,/b]"])
    assert tree == {"train": {"train_iters": "10"}, "scheduler": {"lr_warmup_iters": "3"},
                    "dataset": {"data_path": "[/a,/b]"}}
    assert _check(tree) == []
    assert _check(bp.cli_tree(["train.iters=10"])) == ["train.iters: unknown key (did you mean "
                                                       "'train_iters'?)"]
    for bad in (["+train.new=1"], ["~train.train_iters"], ["train.train_iters"],
                ["train=1", "train.train_iters=2"]):
        with pytest.raises(ValueError):
            bp.cli_tree(bad)


def test_preflight(tmp_path) -> None:
    (tmp_path / "tok").mkdir()
    for suffix in (".bin", ".idx"):
        (tmp_path / f"web{suffix}").write_bytes(b"")
    (tmp_path / "code.bin").write_bytes(b"")
    tree = {"tokenizer": {"tokenizer_model": str(tmp_path / "tok")},
            "dataset": {"data_path": ["0.7", str(tmp_path / "web"), "0.3",
                                      str(tmp_path / "code")]}}
    assert bp.preflight(tree) == [f"dataset.data_path: missing {tmp_path}/code.idx"]
    assert bp.preflight({"tokenizer": {"tokenizer_model": "meta-llama/Llama-3.1-8B"}}) == []
    assert bp.preflight({"tokenizer": {"tokenizer_model": "/nope"}}) == [
        "tokenizer.tokenizer_model: no directory /nope"]


class _Scalar:
    def __init__(self, value: float) -> None:
        self.value = value

    def item(self) -> float:
        return self.value


def _context(step: int, consumed: int, **extra) -> SimpleNamespace:
    state = SimpleNamespace(train_state=SimpleNamespace(step=step,
                                                        consumed_train_samples=consumed))
    return SimpleNamespace(state=state, **extra)


def test_recorder_fills_the_reference_shape(tmp_path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    write_tracker(save, 50)
    rec = SegmentRecorder(started=0.0)
    rec.configure(train_iters=100, seq_length=8, save_dir=str(save))
    assert rec.result["resumed_from"] == {"path": str(save / "iter_0000050"), "iteration": 50}
    rec.on_train_start(_context(50, 400))
    optimizer = SimpleNamespace(param_groups=[{"lr": 3e-4}])
    for step in (51, 52):
        rec.on_train_step_end(_context(step, 400 + 8 * (step - 50), optimizer=optimizer,
                                       loss_dict={"lm loss": _Scalar(2.5)}, grad_norm=1.5))
    rec.on_eval_end(_context(52, 416, total_loss_dict={"lm loss": _Scalar(2.0)}))
    rec.on_checkpoint_save(_context(52, 416))
    write_tracker(save, 52)  # Bridge moves the tracker as part of the save
    r = rec.finish(exit_code=0, error=None)
    assert (r["start_iteration"], r["end_iteration"], r["stop_reason"]) == (50, 52, TIME_LIMIT)
    assert r["last_step"] == 52
    assert r["last_train"] == {"iteration": 52, "lm_loss": 2.5, "learning_rate": 3e-4,
                               "grad_norm": 1.5, "consumed_samples": 416}
    assert r["last_validation"]["val_lm_loss"] == 2.0
    assert r["last_validation"]["val_lm_loss_ppl"] == pytest.approx(7.389, abs=1e-3)
    assert r["checkpoint"] == {"path": str(save / "iter_0000052"), "iteration": 52}
    assert r["saves"] == 1 and r["save_seconds"] >= 0 and r["tokens_consumed"] == 16 * 8
    assert json.loads(json.dumps(r)) == r  # plain JSON


def test_recorder_keys_match_the_reference_trainer() -> None:
    # Read, not imported: reference_trainer imports torch (seconds) at the top.
    tree = ast.parse((REPO / "jobscripts" / "reference_trainer.py").read_text())
    new_result = next(n for n in ast.walk(tree)
                      if isinstance(n, ast.FunctionDef) and n.name == "new_result")
    literal = next(n for n in ast.walk(new_result) if isinstance(n, ast.Dict))
    reference_keys = {k.value for k in literal.keys}
    ours = set(SegmentRecorder(0.0).result)
    assert reference_keys <= ours and ours - reference_keys == {"startup_seconds", "last_step"}


@pytest.mark.parametrize(("end", "signal_name", "code", "error", "reason"), [
    (100, None, 0, None, COMPLETED),
    (100, "SIGTERM", None, None, COMPLETED),  # done wins
    (60, "SIGTERM", None, None, SIGNAL),
    (60, None, 0, None, TIME_LIMIT),
    (60, None, 1, None, FAILED),
    (100, None, 1, "RuntimeError: boom", FAILED),
    (None, None, 0, None, FAILED),  # never reached training
])
def test_stop_reason(end, signal_name, code, error, reason) -> None:
    rec = SegmentRecorder(0.0)
    rec.configure(100, 8, None)
    rec.result["end_iteration"] = end
    rec.signal_name = signal_name
    assert rec.finish(code, error)["stop_reason"] == reason


def _main(tmp_path, config_text: str, *extra: str) -> tuple[int, dict | None]:
    config, result = tmp_path / "bridge.yaml", tmp_path / "segment.json"
    config.write_text(config_text)
    code = bp.main(["--recipe", "llama31_8b", "--config-file", str(config),
                    "--segment-result", str(result), *extra])
    return code, json.loads(result.read_text()) if result.exists() else None


def test_main_refuses_a_bad_config_and_reports_it(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    code, payload = _main(tmp_path, "train: {train_iters: 10}\n"
                                    "tokenizer: {tokenizer_model: /missing/tok}\n")
    assert code == 2 and payload["stop_reason"] == FAILED
    assert "tokenizer.tokenizer_model: no directory /missing/tok" in payload["error"]
    assert payload["train_iters"] == 10


def test_main_without_bridge_fails_loudly(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    code, payload = _main(tmp_path, "train: {train_iters: 10}\n", "train.train_iters=5")
    assert code == 1 and "ModuleNotFoundError" in payload["error"]  # no megatron here


def test_only_rank_zero_writes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert _main(tmp_path, "- not a mapping\n") == (2, None)
