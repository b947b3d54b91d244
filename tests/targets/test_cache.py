"""The tables of measured results every target keeps in the cache: read once while unchanged, updated by
many processes at once without losing an entry, damage read as an empty table, ignored on request."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from neoflow.targets import cache


def _add(path: str, worker: int, count: int) -> None:
    for k in range(count):
        cache.update_table(Path(path), {f"w{worker}-{k}": {"value": k}})


def test_processes_adding_entries_at_once_lose_none(tmp_path: Path) -> None:
    path = tmp_path / "tuning" / "table.json"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_add, args=(str(path), w, 15)) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    table = cache.read_table(path)
    assert len(table) == 60 and table["w3-14"] == {"value": 14}
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".table.json.") and p.suffix != ".lock"]


def test_a_table_is_read_again_when_it_changes_and_damage_reads_as_empty(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "table.json"
    assert cache.read_table(path) == {} and cache.table_digest(path) == "none"
    cache.update_table(path, {"a": {"x": 1}})
    first = cache.table_digest(path)
    cache.update_table(path, {"b": {"x": 2}})
    assert set(cache.read_table(path)) == {"a", "b"} and cache.table_digest(path) != first
    path.write_text('{"a": ')
    assert cache.read_table(path) == {}
    path.write_text("[1, 2]")
    assert cache.read_table(path) == {}
    monkeypatch.setenv("NEOFLOW_TUNING", "0")
    assert cache.table_digest(path) == "off"
