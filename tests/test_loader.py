"""Loading every supported format, and refusing bad input with one clear line and exit code 1."""

import os
import shutil
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmscli import loader
from lmscli.errors import GraphError, InputError, LmsError
from tests.conftest import graph_def_from_nodes, invoke


def _png_bytes() -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"\x00\xff\x00\x00" * 1
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("name,fmt", [
    ("mlp.meta", "metagraph"),
    ("mlp.meta.txt", "metagraph-text"),
    ("frozen_cnn.pb", "graphdef"),
    ("frozen_cnn.pbtxt", "graphdef-text"),
    ("mlp_savedmodel", "savedmodel"),
])
def test_formats_detected(samples, name, fmt):
    model = loader.load(str(samples / name))
    assert model.format == fmt
    assert len(model.graph_def.node) > 0


def test_detection_by_content_not_extension(samples, tmp_path):
    meta_as_pb = tmp_path / "model.pb"
    shutil.copy(samples / "mlp.meta", meta_as_pb)
    assert loader.load(str(meta_as_pb)).format == "metagraph"
    pb_as_meta = tmp_path / "frozen.meta"
    shutil.copy(samples / "frozen_cnn.pb", pb_as_meta)
    assert loader.load(str(pb_as_meta)).format == "graphdef"


def test_format_override_mismatch(samples):
    with pytest.raises(InputError, match="--format"):
        loader.load(str(samples / "frozen_cnn.pb"), fmt="metagraph")


def test_fetch_sources(samples):
    assert loader.load(str(samples / "mlp.meta")).fetch_source == "train_op"
    frozen = loader.load(str(samples / "frozen_cnn.pb"))
    assert frozen.fetch_source == "sinks" and "output" in frozen.fetches
    assert any("sink" in note for note in frozen.notes)
    chosen = loader.load(str(samples / "mlp.meta"), fetch=["loss:0"])
    assert chosen.fetches == ("loss",) and chosen.fetch_source == "option"
    with pytest.raises(InputError, match="--fetch"):
        loader.load(str(samples / "mlp.meta"), fetch=["nope"])


def test_a_training_graph_def_without_collections_runs_its_training_step(tmp_path):
    """A training graph's GraphDef (``tf.io.write_graph``) has no train_op collection: its step is
    the sinks that depend on its inputs, the ``minimize`` NoOp among them, and not the variables'
    initializers (QA: the default step ran the initializers and no update, and its peak was the
    forward pass's)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [64, 32], name="x")
        w1 = v1.get_variable("w1", [32, 64], use_resource=True)
        w2 = v1.get_variable("w2", [64, 1], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ w1) @ w2), name="loss")
        v1.train.AdagradOptimizer(0.1).minimize(loss, name="train_op")
        v1.global_variables_initializer()
    tf.io.write_graph(graph.as_graph_def(), str(tmp_path), "train.pb", as_text=False)
    model = loader.load(str(tmp_path / "train.pb"))
    assert model.fetch_source == "sinks" and "train_op" in model.fetches and "loss" in model.fetches
    assert not [f for f in model.fetches if f.endswith(("Assign", "IsInitialized/VarIsInitializedOp", "init"))]
    from lmscli import api

    prepared = api.prepare(model)
    assert [op for op in prepared.schedule.ops if op.startswith("ResourceApply")]  # the updates run
    chosen = api.analyze(api.prepare(loader.load(str(tmp_path / "train.pb"), fetch=["train_op"]))).peak_bytes
    assert chosen <= api.analyze(prepared).peak_bytes <= chosen * 1.01  # (and x's gradient, a sink)


def test_savedmodel_tags(samples):
    assert loader.load(str(samples / "mlp_savedmodel"), tag="train").saved_model_tag == "train"
    with pytest.raises(InputError, match="no MetaGraphDef with tag"):
        loader.load(str(samples / "mlp_savedmodel"), tag="nonexistent")


def _bad_inputs(tmp_path, samples, tiny_graph_def):
    cases = {}
    cases["missing"] = (tmp_path / "nope.pb", "no such file")
    (tmp_path / "empty.pb").write_bytes(b"")
    cases["empty"] = (tmp_path / "empty.pb", "empty")
    (tmp_path / "image.png").write_bytes(_png_bytes())
    cases["png"] = (tmp_path / "image.png", "not a TensorFlow graph")
    (tmp_path / "random.pb").write_bytes(os.urandom(4096))
    cases["random"] = (tmp_path / "random.pb", "not a TensorFlow graph")
    data = (samples / "mlp.meta").read_bytes()
    (tmp_path / "truncated.meta").write_bytes(data[: len(data) // 3])
    cases["truncated"] = (tmp_path / "truncated.meta", "not a TensorFlow graph")
    os.mkdir(tmp_path / "emptydir")
    cases["dir"] = (tmp_path / "emptydir", "not a SavedModel")
    dangling = graph_def_from_nodes([("a", "Const", [], None), ("b", "Neg", ["ghost:0"], None)])
    (tmp_path / "dangling.pb").write_bytes(dangling.SerializeToString())
    cases["dangling"] = (tmp_path / "dangling.pb", "dangling input")
    dup = graph_def_from_nodes([("a", "NoOp", [], None), ("a", "NoOp", [], None)])
    (tmp_path / "dup.pb").write_bytes(dup.SerializeToString())
    cases["duplicate"] = (tmp_path / "dup.pb", "duplicate node name")
    cyc = graph_def_from_nodes([("a", "Neg", ["b"], None), ("b", "Neg", ["a"], None)])
    (tmp_path / "cycle.pb").write_bytes(cyc.SerializeToString())
    cases["cycle"] = (tmp_path / "cycle.pb", "cycle")
    (tmp_path / "garbage.pbtxt").write_text("node { name: 'a' op: \n this is not protobuf")
    cases["bad text"] = (tmp_path / "garbage.pbtxt", "not a valid text")
    return cases


CASES = ["missing", "empty", "png", "random", "truncated", "dir", "dangling", "duplicate", "cycle", "bad text"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_cli(case, tmp_path, samples, tiny_graph_def, runner):
    path, message = _bad_inputs(tmp_path, samples, tiny_graph_def)[case]
    result = invoke(runner, "analyze", path)
    assert result.exit_code == 1, result.output
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


@pytest.mark.parametrize("command", [("analyze",), ("tune", "--gpu-mem", "1GiB"), ("rewrite", "OUT", "--gpu-mem", "1GiB"),
                                     ("verify", "OTHER"), ("measure",)])
def test_bad_input_with_json_is_an_error_document(command, tmp_path, samples, runner):
    """With --json, a failed command prints a document too (schema lms.error), so that a CI job
    reading stdout gets one for every result; the one line on stderr and exit 1 stay."""
    import json

    bad = tmp_path / "empty.meta"
    bad.write_bytes(b"")
    out = tmp_path / "out.meta"
    args = [a.replace("OUT", str(out)).replace("OTHER", str(samples / "mlp.meta")) for a in command[1:]]
    result = invoke(runner, command[0], bad, *args, "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc == {"schema": "lms.error", "version": 1, "command": command[0], "exit_code": 1,
                   "error": {"type": "InputError", "message": doc["error"]["message"]}}
    assert str(bad) in doc["error"]["message"]
    assert result.stderr.strip() == f"lms: error: {doc['error']['message']}"
    assert not out.exists()


@pytest.mark.parametrize("args", [("rewrite", "MODEL", "OUT", "--gpu-mem", "12XB"), ("tune", "MODEL", "--nosuch"),
                                  ("verify", "MODEL"), ("nosuch",),
                                  # (QA r52: exit 1 after loading the graph)
                                  ("tune", "MODEL", "--gpu-mem", "0.5"), ("tune", "MODEL", "--gpu-mem", "0"),
                                  ("rewrite", "MODEL", "OUT", "--gpu-mem", "9MiB", "--link", "0GB/s"),
                                  # (QA r54: no budget at all, exit 1 after loading the graph)
                                  ("tune", "MODEL"), ("rewrite", "MODEL", "OUT")])
def test_a_usage_error_with_json_is_an_error_document_too(args, tmp_path, samples, runner):
    """Exit 2 with --json prints an lms.error document (QA r50: a bad --gpu-mem gave an empty
    stdout); the usage and the error stay on stderr, as click prints them."""
    import json

    out = tmp_path / "out.meta"
    args = [a.replace("MODEL", str(samples / "mlp.meta")).replace("OUT", str(out)) for a in args]
    result = invoke(runner, *args, "--json")
    assert result.exit_code == 2, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "lms.error" and doc["exit_code"] == 2 and doc["error"]["type"] == "UsageError"
    assert doc["command"] == (None if args[0] == "nosuch" else args[0])
    assert doc["error"]["message"] and doc["error"]["message"] in result.stderr and "Usage:" in result.stderr
    assert not out.exists()
    assert invoke(runner, *args).stdout == ""  # (without --json, nothing on stdout)


def test_a_small_percentage_of_gpu_memory_is_no_usage_error(samples, runner):
    assert invoke(runner, "tune", samples / "mlp.meta", "--gpu-mem", "0.5%", "-q").exit_code in (0, 3)


def test_an_output_into_a_missing_directory_is_refused_before_any_work(tmp_path, samples, runner):
    """QA r52: `lms rewrite ... /nonexistent/dir/out.meta` tuned for 17 s, then said the directory
    does not exist; now it says so first (the graph is not even loaded: a missing model too)."""
    missing = tmp_path / "nodir" / "out.meta"
    for args in (("rewrite", tmp_path / "no.meta", missing, "--gpu-mem", "1MiB"),
                 ("tune", tmp_path / "no.meta", "--gpu-mem", "1MiB", "--plan-out", missing)):
        result = invoke(runner, *args)
        assert result.exit_code == 1 and "nodir" in result.stderr and "does not exist" in result.stderr
        assert "no.meta" not in result.stderr, result.stderr


def test_debug_shows_traceback(tmp_path, runner):
    path = tmp_path / "empty.pb"
    path.write_bytes(b"")
    result = invoke(runner, "--debug", "analyze", path)
    assert result.exit_code == 1
    assert "Traceback" in result.stderr


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_protobufs_never_crash(data, samples, tiny_graph_def):
    """Mutated and truncated protobufs give a graph or an LmsError, never another exception."""
    base = data.draw(st.sampled_from([tiny_graph_def.SerializeToString(),
                                      (samples / "cnn.meta").read_bytes()[:20000]]))
    buf = bytearray(base)
    for _ in range(data.draw(st.integers(0, 8))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(buf)))
    blob = bytes(buf[:cut])
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pb", delete=False) as fh:
        fh.write(blob)
    try:
        model = loader.load(fh.name)
        from lmscli import analysis

        analysis.analyze(analysis.prepare(model))
    except LmsError:
        pass
    finally:
        os.unlink(fh.name)


def test_graph_errors_are_graph_errors(tmp_path):
    cyc = graph_def_from_nodes([("a", "Neg", ["b"], None), ("b", "Neg", ["a"], None)])
    path = tmp_path / "c.pb"
    path.write_bytes(cyc.SerializeToString())
    with pytest.raises(GraphError):
        loader.load(str(path))


def test_atomic_write_and_serialize_round_trip(samples, tmp_path):
    model = loader.load(str(samples / "mlp.meta"))
    for fmt, name in [("metagraph", "a.meta"), ("metagraph-text", "a.meta.txt"),
                      ("graphdef", "a.pb"), ("graphdef-text", "a.pbtxt")]:
        out = tmp_path / name
        loader.atomic_write(str(out), loader.serialize(model, fmt))
        again = loader.load(str(out))
        assert again.format == fmt
        assert len(again.graph_def.node) == len(model.graph_def.node)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".lms-")]


def test_a_batch_size_that_changes_nothing_says_so(samples, runner):
    """QA r52: `lms analyze vit.meta --batch-size 3` showed "batch size 3" beside the figures of
    the graph's fixed batch of 8."""
    import json

    doc = json.loads(invoke(runner, "analyze", samples / "mlp.meta", "--batch-size", "3", "--json").stdout)
    assert doc["batch_size"] is None and any("--batch-size 3 changes nothing" in n for n in doc["notes"])
    doc = json.loads(invoke(runner, "analyze", samples / "unknown_batch.meta", "--batch-size", "3", "--json").stdout)
    assert doc["batch_size"] == 3 and not any("changes nothing" in n for n in doc["notes"])
