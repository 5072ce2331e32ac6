"""The object store beneath the `Store` facade: how a step becomes bytes, ids and refs.

- the canonical encoding behind every id: `encoding.py`, with `keyorder.py`
  and `jsontext.py`;
- what is stored: `bodies.py` (step bodies and blobs), `codec.py`
  (compression), `deltas.py` (blobs as deltas of a base), `lists.py` (message
  lists item by item), `trees.py` (workspace trees);
- writing: `writer.py` (`StepWriter`: append and its caches), `batched.py`
  (a batch's moves), `transactions.py` (a write's own transaction);
- reading history: `history.py` (parents and skip pointers), `graph.py`
  (graph queries), `resolve.py` (names and short ids to steps), `refs.py`
  (runs as refs, the reflog);
- checks of what is stored: `fsck.py`, `fsck_refs.py`.

Nothing here is public API: `kvtrace.store` is.
"""
