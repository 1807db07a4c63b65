"""Shared pieces of the benchmark: paths, the sample generator, the graphs and how they are loaded.

Generated graphs are cached in ``bench/out/`` (gitignored) under a name that spells their shape,
written atomically so two benchmark processes can share the cache.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
OUT = BENCH / "out"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Errors too: TensorFlow's graph-optimizer hook logs one error per Grappler memory-optimizer run
# ("Unable to find OpDef for _CopyFromGpuToHost": the CPU build lacks the swap ops). Failures
# still raise Python exceptions, which the benchmark reports.
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

# The contenders, in table order, with their long and short names.
CONTENDERS = ("original", "grappler-swap", "grappler-heur", "tflms", "lms")
NAMES = {
    "original": "original",
    "grappler-swap": "Grappler SWAPPING_HEURISTICS",
    "grappler-heur": "Grappler HEURISTICS",
    "tflms": "lms --strategy tflms",
    "lms": "lms",
}
SHORT = {
    "original": "original",
    "grappler-swap": "Grappler swapping",
    "grappler-heur": "Grappler heuristics",
    "tflms": "lms tflms",
    "lms": "lms",
}

_GENERATOR = None


def generator():
    """``sample_graphs/generate.py`` as a module (it imports TensorFlow)."""
    global _GENERATOR
    if _GENERATOR is None:
        spec = importlib.util.spec_from_file_location("lms_bench_generate", ROOT / "sample_graphs" / "generate.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _GENERATOR = module
    return _GENERATOR


@dataclass(frozen=True)
class GraphSpec:
    """One benchmark graph: a committed sample (``sample`` is its file) or a generated shape."""

    label: str
    sample: str | None = None
    model: str | None = None
    shape: tuple = ()  # ((keyword, value), ...) for the generator
    batch_size: int | None = None  # for graphs with an unknown batch dimension
    group: str = "sample"  # sample | resnet-res | resnet-batch | unet | synthetic

    @property
    def kwargs(self) -> dict:
        return dict(self.shape)

    def cache_path(self) -> Path:
        parts = [self.model] + [f"{k}{v}" for k, v in self.shape]
        return OUT / ("_".join(parts) + ".meta")


def generated(model: str, **shape) -> GraphSpec:
    return GraphSpec(label=model, model=model, shape=tuple(sorted(shape.items())))


def ensure_generated(spec: GraphSpec) -> tuple[Path, float]:
    """The cached file of a generated graph, writing it first if needed: ``(path, seconds spent)``."""
    path = spec.cache_path()
    if path.exists():
        return path, 0.0
    t = time.perf_counter()
    gen = generator()
    meta = gen.build(spec.model, **spec.kwargs)
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(meta.SerializeToString(deterministic=True))
    os.replace(tmp, path)
    return path, time.perf_counter() - t


def load(spec: GraphSpec):
    """``(api.Model, generation seconds)``."""
    from lmscli import api

    if spec.sample is not None:
        return api.load(str(ROOT / "sample_graphs" / spec.sample)), 0.0
    path, seconds = ensure_generated(spec)
    return api.load(str(path)), seconds


def sup(n: int) -> str:
    """``2`` -> ``²`` for labels such as ResNet-50 2000²."""
    return {2: "\u00b2", 3: "\u00b3"}[n]


SAMPLES = [
    GraphSpec("mlp (sample)", sample="mlp.meta"),
    GraphSpec("mlp text (sample)", sample="mlp.meta.txt"),
    GraphSpec("mlp SavedModel (sample)", sample="mlp_savedmodel"),
    GraphSpec("cnn (sample)", sample="cnn.meta"),
    GraphSpec("resnet50 (sample)", sample="resnet50.meta"),
    GraphSpec("unet3d (sample)", sample="unet3d.meta"),
    GraphSpec("unknown_batch, batch 32 (sample)", sample="unknown_batch.meta", batch_size=32),
    GraphSpec("while_rnn (sample)", sample="while_rnn.meta"),
    GraphSpec("cond_cnn (sample)", sample="cond_cnn.meta"),
    GraphSpec("frozen_cnn (sample)", sample="frozen_cnn.pb"),
]


def resnet_res(size: int) -> GraphSpec:
    return GraphSpec(f"ResNet-50 {size}{sup(2)} b1", model="resnet50",
                     shape=(("batch", 1), ("image_size", size)), group="resnet-res")


def resnet_batch(batch: int) -> GraphSpec:
    return GraphSpec(f"ResNet-50 224{sup(2)} b{batch}", model="resnet50",
                     shape=(("batch", batch), ("image_size", 224)), group="resnet-batch")


def unet(volume: int, batch: int = 1) -> GraphSpec:
    return GraphSpec(f"3D U-Net {volume}{sup(3)} b{batch}", model="unet3d",
                     shape=(("batch", batch), ("volume", volume)), group="unet")


def synthetic(nodes: int) -> GraphSpec:
    return GraphSpec(f"synthetic {nodes:,} nodes", model="synthetic", shape=(("nodes", nodes),), group="synthetic")


LARGE = (
    [resnet_res(s) for s in (2000, 4000, 7500)]
    + [resnet_batch(b) for b in (32, 128, 512)]
    + [unet(v, b) for b in (1, 4) for v in (128, 192, 256)]
    + [synthetic(60000)]
)

QUICK = [
    GraphSpec("cnn (sample)", sample="cnn.meta"),
    unet(64),
    resnet_res(500),
]


@dataclass
class Stopwatch:
    """Wall time of named phases of the run."""

    phases: dict = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds


def pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * 100:.{digits}f}%"


def secs(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"
