"""The report's charts stay readable (report.charts)."""

from __future__ import annotations

import pytest
from report_timelines import memory_record

from keras_tpu_mem.report import summarize_memory


def _epoch_labels(n_epochs, steps_per_epoch=5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from keras_tpu_mem.report import charts

    records = [memory_record(e * steps_per_epoch + s, 1, 100 + s, begin_step=0, epoch=e,
                              phase="compile" if e == s == 0 else "train")
               for e in range(n_epochs) for s in range(1, steps_per_epoch + 1)]
    fig, (ax,) = charts._figure(1, 4.2)
    canvas = FigureCanvasAgg(fig)
    charts._plot_memory(ax, records, summarize_memory(records))
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith(" epoch")]
    return [t.get_text().strip() for t in labels], [t.get_window_extent(renderer) for t in labels]


@pytest.mark.parametrize("n_epochs", [3, 30, 400])
def test_epoch_labels_stay_readable_at_any_number_of_epochs(n_epochs):
    texts, boxes = _epoch_labels(n_epochs)
    assert 1 <= len(texts) <= 8
    if n_epochs == 3:
        assert texts == ["epoch 2", "epoch 3"]  # few epochs: every boundary labelled
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 < b.x0, (texts, a, b)  # no two labels touch
