"""A tour of the trace store through the public API: record, log, fork, revert,
reflog, reset, note, fsck, export and import.

Run: .venv/bin/python examples/store_tour.py [STORE_DIR]
(default: a fresh temporary folder, so your own .kvtrace/ is untouched).
"""

from __future__ import annotations

import io
import sys
import tempfile
from pathlib import Path

import kvtrace


def main(folder: Path) -> None:
    store = kvtrace.open_store(f"sqlite:///{folder / 'tour.db'}")
    run = store.run("tour")
    question = [{"role": "user", "content": "What is 17 * 23?"}]
    run.record_model_call(
        question,
        {"role": "assistant", "content": 'Action: calc {"expr": "17 * 23"}'},
        model="SmolLM2-135M-Instruct",
        params={"temperature": 0},
    )
    run.record_tool_call("calc", {"expr": "17 * 23"}, "391")
    run.record_model_call(
        [*question, {"role": "tool", "content": "391"}],
        {"role": "assistant", "content": "Final answer: 391"},
        model="SmolLM2-135M-Instruct",
    )

    print("== log tour (head first)")
    for step in store.log("tour"):
        print(f"  {step.depth} {step.short_id} {step.kind}")

    print("== fork at tour@1 with an edited tool result, then continue the fork")
    fork = store.fork("tour@1", "tour-edited")
    fork.record_tool_call("calc", {"expr": "17 * 23"}, "390")
    print(f"  tour-edited head {fork.head.short_id if fork.head else None}")

    print("== revert tour to tour@1, then undo it through the reflog")
    store.revert("tour", to="tour@1")
    for entry in store.reflog("tour")[:2]:
        print(
            f"  reflog: {entry.reason:7} {str(entry.old_head)[:12]} -> {str(entry.new_head)[:12]}"
        )
    store.undo("tour")
    print(f"  tour is back at depth {store.show('tour').depth}")

    store.note("tour@2", "tool result checked by hand", author="supervisor")
    report = store.fsck()
    print(
        f"== fsck: {report.num_steps} steps, {report.num_blobs} blobs, problems={report.problems}"
    )

    bundle = io.BytesIO()
    store.export_run("tour", bundle)
    other = kvtrace.open_store(f"sqlite:///{folder / 'copy.db'}")
    info = other.import_bundle(io.BytesIO(bundle.getvalue()))
    print(f"== export/import: same head id: {info.head_id == store.resolve('tour')}")
    other.close()
    store.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
