"""Where raw documents come from: hf:// and s3:// sources, from the campaign file to the job.

The URI parsers are pure and shared by the campaign schema (a bad URI fails at DAG parse,
naming ``data.source``) and the ingest job. S3 is exercised against a real S3 API (moto's
server on a free port), with boto3 finding keys and endpoint the way it would on a cluster.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobscripts.hf_fetch import HfSource, matching_files, parse_hf_uri
from jobscripts.s3_fetch import S3Source, parse_s3_uri
from operators.campaign.render import stages
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import CampaignConfigError, campaign_from_dict, load_campaign
from tests.campaign.util import DEMO, LLAMA_8B, edited, raw
from tests.support.data_stage import parquet_bytes, run_main
from tests.support.mlflow_server import S3_KEY_ID, S3_SECRET

FINEWEB = "hf://datasets/HuggingFaceFW/fineweb"


@pytest.mark.parametrize(("uri", "expected"), [
    (f"{FINEWEB}/sample/10BT/000_00000.parquet",
     HfSource("HuggingFaceFW/fineweb", "sample/10BT/000_00000.parquet")),
    (f"{FINEWEB}/sample/10BT/*.parquet",
     HfSource("HuggingFaceFW/fineweb", "sample/10BT/*.parquet")),
    (f"{FINEWEB}/sample/10BT", HfSource("HuggingFaceFW/fineweb", "sample/10BT/*.parquet")),
    (f"{FINEWEB}/sample/10BT/", HfSource("HuggingFaceFW/fineweb", "sample/10BT/*.parquet")),
    (f"{FINEWEB}@v1.4.0/data/CC-MAIN-2024-10/*.parquet",
     HfSource("HuggingFaceFW/fineweb", "data/CC-MAIN-2024-10/*.parquet", "v1.4.0")),
    ("hf://datasets/my-org/corpus.v2@0f3e9c1/train/part-[0-3].parquet",
     HfSource("my-org/corpus.v2", "train/part-[0-3].parquet", "0f3e9c1")),
])
def test_hf_uri_to_repo_pattern_revision(uri, expected):
    assert parse_hf_uri(uri) == expected


@pytest.mark.parametrize(("uri", "fragment"), [
    ("hf://models/meta-llama/Llama-3.1-8B/model.parquet", "only dataset repositories"),
    ("hf://HuggingFaceFW/fineweb/x.parquet", "only dataset repositories"),
    (FINEWEB, "name the files"),
    (f"{FINEWEB}/", "name the files"),
    ("hf://datasets/HuggingFaceFW", "name the files"),
    (f"{FINEWEB}/sample//x.parquet", "empty path components"),
    ("hf://datasets/-org/name/x.parquet", "owner '-org'"),
    ("hf://datasets/org/na--me/x.parquet", "dataset name 'na--me'"),
    ("hf://datasets/org/name./x.parquet", "dataset name 'name.'"),
    (f"hf://datasets/org/{'n' * 97}/x.parquet", "at most 96"),
    (f"{FINEWEB}@/x.parquet", "revision ''"),
    (f"{FINEWEB}@-rev/x.parquet", "revision '-rev'"),
    (f"{FINEWEB}/sample/10BT/*.json", "must select Parquet"),
    (f"{FINEWEB}/sample/10BT/*", "must select Parquet"),
    (f"{FINEWEB}/./x.parquet", "'.' and '..'"),
])
def test_hf_uri_refused_with_reason(uri, fragment):
    with pytest.raises(ValueError) as caught:
        parse_hf_uri(uri)
    assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("uri", "expected"), [
    ("s3://corpus/fineweb/sample", S3Source("corpus", "fineweb/sample/", "**/*.parquet")),
    ("s3://corpus/fineweb/sample/", S3Source("corpus", "fineweb/sample/", "**/*.parquet")),
    ("s3://corpus", S3Source("corpus", "", "**/*.parquet")),
    ("s3://corpus/fineweb/000_*.parquet", S3Source("corpus", "fineweb/", "000_*.parquet")),
    ("s3://corpus/*/x/*.parquet", S3Source("corpus", "", "*/x/*.parquet")),
    ("s3://my.bucket-1/a/b.parquet", S3Source("my.bucket-1", "a/b.parquet", "")),
    ("s3://corpus/a/b.parquet/", S3Source("corpus", "a/b.parquet/", "**/*.parquet")),
])
def test_s3_uri_to_bucket_prefix_pattern(uri, expected):
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize(("uri", "fragment"), [
    ("s3://Corpus/x", "not an S3 bucket name"),
    ("s3://ab/x", "not an S3 bucket name"),
    ("s3://bad_bucket/x", "not an S3 bucket name"),
    ("s3://10.0.0.1/x", "not an S3 bucket name"),
    ("s3://corpus/a//b.parquet", "empty, '.' and '..'"),
    ("s3://corpus/a/*.json", "must select Parquet"),
    ("gs://corpus/a", "starts with s3://"),
])
def test_s3_uri_refused_with_reason(uri, fragment):
    with pytest.raises(ValueError) as caught:
        parse_s3_uri(uri)
    assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("source", "fragment"), [
    ("hf://models/org/name/x.parquet", "only dataset repositories"),
    (FINEWEB, "name the files"),
    (f"{FINEWEB}/sample/*.json", "must select Parquet"),
    ("s3://Corpus/fineweb", "not an S3 bucket name"),
    ("gs://corpus/fineweb", "only s3:// and hf://"),
])
def test_a_bad_source_uri_fails_when_the_campaign_loads(source, fragment, tmp_path):
    from tests.campaign.util import dump

    path = tmp_path / "campaign.yaml"
    path.write_text(dump(edited(raw(DEMO), {"data.source": source})))
    with pytest.raises(CampaignConfigError) as caught:
        load_campaign(path)
    (problem,) = caught.value.problems
    assert problem.field == "data.source" and fragment in problem.message, str(caught.value)
    assert problem.line is not None and str(path) in str(caught.value)


def _ingest_argv(source: str) -> list[str]:
    campaign = campaign_from_dict(edited(raw(LLAMA_8B), {"data.source": source}))
    command = stages.ingest(campaign, Layout.for_campaign(campaign))["command"]
    argv = shlex.split(command.splitlines()[-1])  # the site's set-up lines come first
    assert argv[:3] == ["$PP_PYTHON", "-m", "jobscripts.ingest"] and argv[-2] == "--result"
    return argv[3:-2]  # run_main adds its own --result


@pytest.mark.parametrize(("source", "flags"), [
    (f"{FINEWEB}/sample/10BT/000_00000.parquet",
     ["--hf-repo", "HuggingFaceFW/fineweb", "--hf-allow-pattern", "sample/10BT/000_00000.parquet"]),
    (f"{FINEWEB}@v1.4.0/sample/10BT",
     ["--hf-repo", "HuggingFaceFW/fineweb", "--hf-allow-pattern", "sample/10BT/*.parquet",
      "--hf-revision", "v1.4.0"]),
    ("s3://corpus/fineweb/*.parquet", ["--input", "s3://corpus/fineweb/*.parquet"]),
    ("/scratch/fineweb/*.parquet", ["--input", "/scratch/fineweb/*.parquet"]),
])
def test_ingest_stage_passes_the_source_as_ingest_flags(source, flags):
    argv = _ingest_argv(source)
    assert argv[:len(flags)] == flags and argv[len(flags)] == "--output-dir"
    from jobscripts.ingest import parser

    parser().parse_args(argv)  # flags the job understands


def test_the_8b_campaigns_ingest_job_fails_at_once_when_offline(tmp_path, monkeypatch):
    """The command the DAG renders for the production campaign, run on an offline node."""
    from jobscripts.ingest import main

    argv = _ingest_argv(raw(LLAMA_8B)["data"]["source"])
    out = argv.index("--output-dir") + 1
    argv[out] = str(tmp_path / "ingest")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    code, result, _ = run_main(main, argv, tmp_path / "r.json")
    assert code == 1 and time.monotonic() - started < 5
    assert "HF_HUB_OFFLINE=1" in result["error"] and "--input" in result["error"]


def test_ingest_input_hf_uri_takes_the_same_route(tmp_path, monkeypatch):
    from jobscripts.ingest import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on discard
    argv = ["--input", f"{FINEWEB}/sample/10BT/*.parquet", "--output-dir", str(tmp_path)]
    code, result, _ = run_main(main, argv, tmp_path / "r.json")
    assert code == 1 and "127.0.0.1:9 is unreachable" in result["error"]
    argv[1] = "hf://models/x/y/z.parquet"
    code, result, _ = run_main(main, argv, tmp_path / "r.json")
    assert code == 1 and "only dataset repositories" in result["error"]


def test_hf_download_reads_only_what_its_patterns_select(tmp_path):
    for name in ("sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet",
                 "sample/100BT/000_00000.parquet", ".cache/huggingface/x.parquet", "README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    pattern = parse_hf_uri(f"{FINEWEB}/sample/10BT").allow_pattern
    assert matching_files(tmp_path, [pattern]) == ["sample/10BT/000_00000.parquet",
                                                   "sample/10BT/001_00000.parquet"]
    assert matching_files(tmp_path, ["sample/*/000_*.parquet"]) == [
        "sample/100BT/000_00000.parquet", "sample/10BT/000_00000.parquet"]


def test_ingest_reads_a_single_local_parquet_file(tmp_path):
    from jobscripts.ingest import main, split_input

    table = pa.table({"text": ["one document here", "another document"], "id": ["a", "b"]})
    pq.write_table(table, tmp_path / "one.parquet")
    pq.write_table(table, tmp_path / "two.parquet")
    assert split_input(str(tmp_path / "one.parquet")) == (str(tmp_path), "one.parquet")
    argv = ["--input", str(tmp_path / "one.parquet"), "--output-dir", str(tmp_path / "out"),
            "--workers", "1"]
    code, result, _ = run_main(main, argv, tmp_path / "r.json")
    assert code == 0, result
    assert result["input_files"] == 1 and result["docs_out"] == 2


# --- s3:// against a real S3 API ---------------------------------------------------------------
BUCKET = "pp-corpus"


SHARDS = {
    "fineweb/sample/000_00000.parquet": [(f"first shard document {i}", f"a{i}") for i in range(5)],
    "fineweb/sample/001_00000.parquet": [(f"second shard document {i}", f"b{i}") for i in range(3)],
    "fineweb/sample/deeper/002_00000.parquet": [("a document one level down", "c0")],
}


@pytest.fixture(scope="module")
def s3(moto_s3):
    client = moto_s3.client()
    client.create_bucket(Bucket=BUCKET)
    for key, rows in SHARDS.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=parquet_bytes(rows))
    client.put_object(Bucket=BUCKET, Key="fineweb/sample/README.md", Body=b"# not data")
    client.put_object(Bucket=BUCKET, Key="other/000_00000.parquet",
                      Body=parquet_bytes([("elsewhere", "z")]))
    return moto_s3


@pytest.fixture
def cluster_env(s3, tmp_path, monkeypatch):
    """boto3's default chain as a cluster user would have it: a credentials file in the
    user's AWS directory and the endpoint in the environment; nothing on the command line."""
    aws = tmp_path / "aws"
    aws.mkdir()
    (aws / "credentials").write_text(
        f"[default]\naws_access_key_id = {S3_KEY_ID}\naws_secret_access_key = {S3_SECRET}\n")
    (aws / "config").write_text("[default]\nregion = us-east-1\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(aws / "config"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role probe here
    return aws


def test_s3_download_selects_and_resumes_by_etag(s3, cluster_env, tmp_path):
    from jobscripts import s3_fetch

    target = tmp_path / "download"
    first = s3_fetch.download("s3://pp-corpus/fineweb/sample/", target)
    assert first["files"] == ["000_00000.parquet", "001_00000.parquet",
                              "deeper/002_00000.parquet"]
    assert (first["fetched"], first["kept"], first["endpoint"]) == (3, 0, s3.url)
    assert not list(target.rglob(".*.part"))
    # a rerun (retried task, job cut by its time limit) fetches nothing it already holds
    again = s3_fetch.download("s3://pp-corpus/fineweb/sample/", target)
    assert (again["fetched"], again["kept"]) == (0, 3)
    # a changed object (new ETag) and a truncated local copy are fetched again
    s3.client().put_object(Bucket=BUCKET, Key="fineweb/sample/000_00000.parquet",
                           Body=parquet_bytes([("replaced", "r")]))
    (target / "001_00000.parquet").write_bytes(b"trunc")
    third = s3_fetch.download("s3://pp-corpus/fineweb/sample/", target)
    assert (third["fetched"], third["kept"]) == (2, 1)
    assert pq.read_table(target / "000_00000.parquet").column("text").to_pylist() == ["replaced"]
    s3.client().put_object(Bucket=BUCKET, Key="fineweb/sample/000_00000.parquet",
                           Body=parquet_bytes(SHARDS["fineweb/sample/000_00000.parquet"]))
    # a glob stays in its directory; one object by its key
    assert s3_fetch.download("s3://pp-corpus/fineweb/sample/0*.parquet",
                             tmp_path / "g")["files"] == ["000_00000.parquet",
                                                          "001_00000.parquet"]
    assert s3_fetch.download("s3://pp-corpus/other/000_00000.parquet",
                             tmp_path / "one")["files"] == ["000_00000.parquet"]


def test_ingest_from_s3_writes_jsonl(s3, cluster_env, tmp_path):
    from jobscripts.ingest import main

    argv = ["--input", "s3://pp-corpus/fineweb/sample", "--output-dir", str(tmp_path / "out"),
            "--workers", "1"]
    code, result, log = run_main(main, argv, tmp_path / "r.json")
    assert code == 0, result
    assert result["input_files"] == 3 and result["docs_out"] == 9
    assert result["downloaded"]["fetched"] == 3 and result["downloaded"]["endpoint"] == s3.url
    texts = {json.loads(line)["text"] for f in result["jsonl_files"]
             for line in Path(f).read_text().splitlines()}
    assert texts == {r[0] for rows in SHARDS.values() for r in rows}
    assert S3_SECRET not in log and S3_SECRET not in json.dumps(result)
    # the rerun of a finished ingest downloads nothing and reads the same documents
    code, again, _ = run_main(main, argv, tmp_path / "r2.json")
    assert code == 0 and again["downloaded"]["kept"] == 3 and again["docs_out"] == 9


@pytest.mark.parametrize(("uri", "env", "fragment"), [
    ("s3://pp-corpus/fineweb/sample", {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"},
     "no AWS credentials"),
    ("s3://pp-missing/fineweb", {}, "NoSuchBucket"),
    ("s3://pp-corpus/nothing/here", {}, "no Parquet object matches s3://pp-corpus/nothing/here"),
    ("s3://pp-corpus/fineweb/sample", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                                       "AWS_MAX_ATTEMPTS": "1"}, "cannot reach the S3 endpoint"),
])
def test_s3_failures_say_what_to_fix(s3, cluster_env, tmp_path, monkeypatch, uri, env, fragment):
    from jobscripts.ingest import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    code, result, _ = run_main(main, ["--input", uri, "--output-dir", str(tmp_path)],
                               tmp_path / "r.json")
    assert code == 1 and fragment in result["error"], result["error"]
    assert time.monotonic() - started < 30
