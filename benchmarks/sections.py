"""Every section, in the order ``all`` runs them and the report lists them."""

from __future__ import annotations

from benchmarks import (
    blas,
    evaluate,
    generate,
    loss,
    memory,
    memory_fit,
    moba,
    models,
    parallel,
    preference,
    serve,
    train,
    train_int8,
    wkv7,
)
from benchmarks.common import Section

SECTIONS: dict[str, Section] = {
    "blas": blas.SECTION,
    "wkv7": wkv7.SECTION,
    "moba": moba.SECTION,
    "models": models.SECTION,
    "loss": loss.SECTION,
    "train": train.SECTION,
    "preference": preference.SECTION,
    "generate": generate.SECTION,
    "evaluate": evaluate.SECTION,
    "serve": serve.SECTION,
    "parallel": parallel.SECTION,
    "train-int8": train_int8.SECTION,
    "memory": memory.SECTION,
    "memory-fit": memory_fit.SECTION,
}
