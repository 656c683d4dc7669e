"""The engine's typed result: one document out (to_json), the same result back in (from_json)."""
from __future__ import annotations

import os

import orjson

from gpuwatch.apps.commandline import json_text
from gpuwatch.efficiency.engine import analyze
from gpuwatch.efficiency.load import load_paths
from gpuwatch.efficiency.result import Analysis, Coverage, RankBreakdown, StepBreakdown, WhatIf
from helpers import KINETO_DATA

DATA = KINETO_DATA
SAMPLED = os.path.join(DATA, "sampled_2ranks_of128")


def test_the_document_reads_back_into_the_same_typed_result():
    result = analyze(load_paths([SAMPLED]), per_step=True)
    assert isinstance(result.coverage, Coverage) and isinstance(result.what_if, WhatIf)
    assert isinstance(result.ranks[0], RankBreakdown) and isinstance(result.ranks[0].per_step[0], StepBreakdown)
    doc = orjson.loads(orjson.dumps(result.to_json()))  # as sent on the wire
    again = Analysis.from_json(doc)
    assert again == result  # partitions and timelines were not kept, so every field compares
    assert list(again.to_json()) == list(doc)  # keys in the same order
    # the keys acceptance checks read
    assert (doc["coverage"]["ranks_present"], doc["coverage"]["world_size"]) == (2, 128)
    assert doc["straggler_verdict"] == "undetermined" and doc["what_if"]["slowdown"] >= 1.0


def test_the_document_as_json_text_is_what_the_command_line_prints_for_it():
    """`gpuwatch analyze --json` writes the document with msgspec (loaded already), other commands with
    orjson: the two texts are the same."""
    for trace in (SAMPLED, os.path.join(DATA, "ns_resolution_rank0")):
        result = analyze(load_paths([trace]), per_step=True)
        text = result.json_text()
        assert text == json_text(result.to_json()) and orjson.loads(text) == result.to_json()
        assert text.startswith('{\n  "') and text.count("\n") > 100  # indented by two spaces


def test_segments_ride_along_but_never_enter_the_document():
    result = analyze(load_paths([SAMPLED]), keep_segments=True)
    assert len(result.partitions) == len(result.timelines) == 2
    doc = result.to_json()
    assert not {"partitions", "timelines", "_partitions", "_timelines"} & set(doc)
    assert "per_step" not in doc["ranks"][0]  # only with per_step=True
    orjson.dumps(doc)  # plain data


def test_extra_keys_of_a_stored_document_are_left_out():
    doc = {**analyze(load_paths([SAMPLED])).to_json(), "source": "traces", "history": {"steps": 3}}
    assert Analysis.from_json(doc).to_json() == {k: v for k, v in doc.items() if k not in ("source", "history")}
