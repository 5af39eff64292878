"""The report's text: what a folder holds, and where memory figures come from (report.summary)."""

from __future__ import annotations

from report_timelines import decode, memory_record, throughput_record, write_timeline

from keras_tpu_mem.report import summarize_memory, write_report


def test_a_folder_without_memory_says_memory_was_not_recorded(tmp_path):
    run = tmp_path / "run"
    write_timeline(run / "ktm_throughput" / "timeline.jsonl",
                    [throughput_record(s, 1, begin_step=0, phase="compile" if s == 1 else "train")
                     for s in (1, 2, 3)])
    text = write_report(str(tmp_path), charts=False).text
    assert "holds: throughput (ktm_throughput/)" in text
    assert "memory: not recorded - no ktm_memory/timeline.jsonl in this folder" in text
    assert "HBMMonitor(log_dir)" in text

    only_memory = tmp_path / "other"
    write_timeline(only_memory / "ktm_memory" / "timeline.jsonl",
                    [memory_record(1, 1, 100, begin_step=0, phase="compile")])
    report = write_report(str(tmp_path), charts=False)
    block = report.text[report.text.index(f"run folder: {only_memory}"):]
    assert "throughput: not recorded - no ktm_throughput/timeline.jsonl" in block
    assert report.runs[str(only_memory)]["has_throughput"] is False


def test_host_rss_figures_are_named_in_the_table_and_chart(tmp_path):
    records = [memory_record(s, 1, 800 * 2**20 + s * 2**20, begin_step=0, source="host_rss",
                              device="CPU (process RSS)", phase="compile" if s == 1 else "train")
               for s in (1, 2, 3)]
    write_timeline(tmp_path / "ktm_memory" / "timeline.jsonl", records)
    report = write_report(str(tmp_path))
    row = next(ln for ln in report.text.splitlines() if ln.startswith("CPU (process RSS)"))
    assert "host RSS (process)" in row and "[shared]" not in row
    assert "not HBM" in report.text
    info = report.runs[str(tmp_path)]["memory"]["CPU (process RSS)"]
    assert info["source"] == "host_rss" and info["process_wide"] is True
    decode(report.charts[0])

    # Timelines written before sources were recorded read as allocator figures.
    old = [{k: v for k, v in r.items() if k != "memory_source"} for r in records]
    for r in old:
        for reading in r["devices"].values():
            reading.pop("source"), reading.pop("process_wide")
    assert summarize_memory(old)["CPU (process RSS)"]["source"] == "allocator"
