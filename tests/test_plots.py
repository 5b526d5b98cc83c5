"""A run's plots and TensorBoard events read at a glance: integer rounds, bytes without offsets,
wire bytes and baselines drawn, grouped tags, hparams and the config, one round numbering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedml_ssfl import tracking
from fedml_ssfl.cli import main
from fedml_ssfl.runtime.local import run_local
from fedml_ssfl.tracking import accuracy_figure, bytes_figure, metric_tag, plot_run, round_numbers
from tests.conftest import SMALL


def drawn(fig):
    """Lay the figure out as saving it would (tick positions, offset text)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig


def visible_ticks(ax) -> list[float]:
    lo, hi = ax.get_xlim()
    return [float(t) for t in ax.get_xticks() if lo <= t <= hi]


def lines_by_label(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


def assert_legend_outside_the_axes(fig) -> list[str]:
    """The figure's one legend lies off every axes (so never over the data); returns its entries."""
    drawn(fig)
    assert not any(ax.get_legend() for ax in fig.axes), "a legend inside an axes"
    (legend,) = fig.legends
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent()), (box, ax.get_window_extent())
    return [t.get_text() for t in legend.get_texts()]


def assert_accuracy_axis(ax, chance: float | None) -> None:
    """0 to 100% whatever the data, with the chance level dotted (or no chance line)."""
    assert ax.get_ylim() == (0.0, 100.0)
    assert ax.get_ylabel() == "test accuracy (%)"
    lines = [line for line in ax.get_lines() if line.get_label().startswith("chance")]
    if chance is None:
        assert not lines
        return
    (line,) = lines
    assert list(line.get_ydata()) == pytest.approx([chance, chance]) and line.get_linestyle() == ":"


def test_accuracy_plot_has_integer_round_ticks_and_the_baselines(tmp_path: Path) -> None:
    rows = [{"round": n, "test_acc": a} for n, a in ((1, 0.5), (2, 0.7), (3, 0.8))]
    base = [{"round": n, "test_acc": a} for n, a in ((1, 0.3), (2, 0.4), (3, 0.45))]
    fig = drawn(accuracy_figure(rows, "run", "semifl", {"server_only": base}))
    ax = fig.axes[0]
    ticks = visible_ticks(ax)  # three rounds: matplotlib's default would put ticks at 1.25, 1.5, ...
    assert ticks and all(t.is_integer() for t in ticks), ticks
    lines = lines_by_label(ax)
    baseline = next(line for label, line in lines.items() if label.startswith("server_only"))
    assert list(baseline.get_xdata()) == [1, 2, 3]
    assert list(baseline.get_ydata()) == pytest.approx([30, 40, 45])
    own = next(line for label, line in lines.items() if label.startswith("semifl"))
    assert list(own.get_ydata()) == pytest.approx([50, 70, 80]) and "80.0%" in own.get_label()
    one = drawn(accuracy_figure(rows[:1], "run", "semifl", {"server_only": base[:1]})).axes[0]
    assert visible_ticks(one) == [1.0]  # a one-round run: matplotlib would fall back to 0.95, 0.975, ...


def test_accuracy_plot_reads_at_a_glance_whatever_the_range() -> None:
    """Issue 30: a 2-round run spanning 39.25-40.75% autoscaled into what looked like a collapse."""
    rows = [{"round": 1, "test_acc": 0.4075}, {"round": 2, "test_acc": 0.3925}]
    fig = accuracy_figure(rows, "mnist5k_semifl", "semifl", num_classes=10, subtitle="semifl on mnist5k, seed 0")
    ax = fig.axes[0]
    assert_accuracy_axis(ax, 10.0)
    entries = assert_legend_outside_the_axes(fig)
    assert entries == ["semifl: 39.2%", "chance (1/10): 10.0%"]
    assert ax.get_title() == "mnist5k_semifl: test accuracy\nsemifl on mnist5k, seed 0"
    unknown = accuracy_figure(rows, "r", "semifl")  # a run folder written before summary.json had num_classes
    assert_accuracy_axis(unknown.axes[0], None)


def test_bytes_plot_has_a_unit_no_offset_and_the_wire_line() -> None:
    # the case: ~0.93 MiB per round, rounds differing by 80 bytes (an offset axis showed a wide gap)
    payload = [971_500, 971_580, 971_540]
    rows = [
        {"round": n + 1, "bytes_up": b, "bytes_down": b, "state_bytes_up": 1000, "wire_bytes_up": b + 1500}
        for n, b in enumerate(payload)
    ]
    fig = drawn(bytes_figure(rows, "run"))
    up, down = fig.axes
    assert up.get_ylabel() == "KiB per round"
    for ax in (up, down):
        assert ax.yaxis.get_major_formatter().get_useOffset() is False
        assert ax.yaxis.get_offset_text().get_text() == ""
        assert ax.get_ylim()[0] == 0  # from zero: 80 bytes out of 0.93 MiB look as small as they are
        assert all(float(t).is_integer() for t in visible_ticks(ax))
    wire = next(line for label, line in lines_by_label(up).items() if "wire" in label)
    assert list(wire.get_ydata()) == pytest.approx([(b + 1500) / 1024 for b in payload])
    assert not any("wire" in label for label in lines_by_label(down))  # no wire_bytes_down measured
    big = drawn(bytes_figure([{"round": 1, "bytes_up": 3 * 2**20, "bytes_down": 2**20}], "run"))
    assert big.axes[0].get_ylabel() == "MiB per round"
    (payload,) = big.axes[0].containers  # one bar per round
    assert payload.get_label() == "algorithm payload" and [bar.get_height() for bar in payload] == [3.0]
    local = bytes_figure([{"round": 1, "bytes_up": 10, "bytes_down": 10}], "run")
    assert not any("wire" in label for ax in local.axes for label in lines_by_label(ax))


def test_bytes_plot_has_one_legend_outside_and_says_when_nothing_was_sent() -> None:
    """server_only sends nothing up: that panel says so and draws nothing, and no legend sits on it."""
    rows = [{"round": n, "bytes_up": 0, "bytes_down": 80} for n in (1, 2, 3)]
    fig = bytes_figure(rows, "server_only", subtitle="server_only on mnist5k, cnn28-bn, local, seed 0")
    up, down = fig.axes
    assert assert_legend_outside_the_axes(fig) == ["algorithm payload"]
    assert not up.containers and not up.get_lines()
    assert [t.get_text() for t in up.texts] == ["nothing sent this way"]
    assert not down.texts and [bar.get_height() for bar in down.containers[0]] == [80, 80, 80]
    assert fig.get_suptitle() == "server_only: bytes per round\nserver_only on mnist5k, cnn28-bn, local, seed 0"
    assert [float(t) for t in visible_ticks(up)] == [1.0, 2.0, 3.0]


def test_metric_tags_fall_into_four_groups() -> None:
    expected = {
        "test_acc": "test/acc",
        "test_acc_min": "test/acc_min",
        "final_test_acc": "test/final_acc",
        "client_mask_rate": "client/mask_rate",
        "bytes_up": "comm/bytes_up",
        "wire_bytes_down": "comm/wire_bytes_down",
        "state_bytes_up": "comm/state_bytes_up",
        "c2s_cost": "comm/c2s_cost",
        "seconds": "comm/seconds",
        "clients": "comm/clients",
        "lr": "algo/lr",
        "weight_diversity": "algo/weight_diversity",
    }
    assert {k: metric_tag(k) for k in expected} == expected


def test_round_numbers_are_one_based_also_for_older_rows() -> None:
    assert round_numbers([{"round": 1}, {"round": 2}]) == [1, 2]
    assert round_numbers([{"round": 0}, {"round": 1}]) == [1, 2]  # metrics.jsonl written before 1-based rounds


def test_tensorboard_has_grouped_tags_hparams_config_and_the_plots_rounds(small_config, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    cfg = small_config("tracking_args.enable_tensorboard=true")
    res = run_local(cfg, run_dir=tmp_path / "run")
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(res.run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert tags and all(t.split("/")[0] in ("test", "comm", "client", "algo") for t in tags), tags
    assert {"test/acc", "comm/bytes_up", "client/loss", "algo/lr"} <= set(tags)
    # one round numbering: TensorBoard steps = metrics.jsonl rounds = 1, 2
    assert [e.step for e in events.Scalars("test/acc")] == [r["round"] for r in rows] == [1, 2]
    assert [e.value for e in events.Scalars("test/acc")] == pytest.approx([r["test_acc"] for r in rows])
    final = events.Scalars("test/final_acc")
    assert [e.step for e in final] == [2] and final[0].value == pytest.approx(res.final_acc)
    assert events.Scalars("comm/wall_seconds")[0].value == pytest.approx(res.summary["wall_seconds"])
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["ssfl_args.algorithm"].string_value == cfg.algorithm
    assert hparams["train_args.comm_round"].number_value == 2
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "comm_round: 2" in text and "dataset: digits" in text
    assert res.summary["wall_seconds"] >= res.summary["seconds_total"] > 0


def test_the_tensorboard_writer_is_made_at_the_first_round_or_at_close(tmp_path: Path) -> None:
    """The writer waits for the first logged round (issue 15), writing the config logged before it
    first, at step 0 with the wall time it was logged at; a run closed before any round still gets
    its config in TensorBoard; a run folder that went away is not re-created by the close."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(run: Path) -> EventAccumulator:
        events = EventAccumulator(str(run / tracking.TB_DIR), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        return events

    logged = tracking.RunTracker(tmp_path / "logged")
    logged.log_config({"train_args": {"comm_round": 3}})
    assert not (tmp_path / "logged" / tracking.TB_DIR).exists()  # nothing made before a round is logged
    logged.log_round({"round": 1, "test_acc": 0.5})
    logged.close()
    events = read(tmp_path / "logged")
    (config,) = events.Tensors("config/text_summary")
    (acc,) = events.Scalars("test/acc")
    assert config.step == 0 and "comm_round: 3" in config.tensor_proto.string_val[0].decode()
    assert (acc.step, acc.value) == (1, 0.5) and config.wall_time <= acc.wall_time

    closed = tracking.RunTracker(tmp_path / "closed")
    closed.log_config({"train_args": {"comm_round": 4}})
    closed.close()
    (config,) = read(tmp_path / "closed").Tensors("config/text_summary")
    assert "comm_round: 4" in config.tensor_proto.string_val[0].decode()

    gone = tracking.RunTracker(tmp_path / "gone")
    gone.log_config({"train_args": {"comm_round": 5}})
    (tmp_path / "gone" / "metrics.jsonl").unlink()
    (tmp_path / "gone").rmdir()
    gone.close()
    assert not (tmp_path / "gone").exists()


def test_a_tensorboard_write_failing_at_close_is_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    """``close`` runs in a run's ``finally``: a full disk there must not replace the run's own error."""

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tracking, "_summary_writer", no_space)
    tracker = tracking.RunTracker(tmp_path / "full")
    tracker.log_config({"train_args": {"comm_round": 3}})
    with caplog.at_level("WARNING", logger="fedml_ssfl.tracking"):
        tracker.close()
    assert "could not write the TensorBoard events" in caplog.text and "No space left" in caplog.text


def test_run_draws_its_compare_with_baselines_on_accuracy_png(tmp_path: Path, monkeypatch, capsys) -> None:
    figures = []
    real = tracking.accuracy_figure

    def keep(rows, title, *args, **kwargs):
        figures.append((title, real(rows, title, *args, **kwargs)))
        return figures[-1][1]

    monkeypatch.setattr(tracking, "accuracy_figure", keep)
    args = [*SMALL, f"common_args.output_dir={tmp_path}", "common_args.compare_with=[server_only]"]
    assert main(["run", *(x for s in args for x in ("--set", s))]) == 0
    (run_dir,) = (p.parent for p in tmp_path.glob("*/compare"))
    title, fig = [f for f in figures if f[0] == run_dir.name][-1]  # the last drawing of the run's accuracy.png
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert any(label.startswith("server_only (baseline)") for label in labels), labels
    assert any(label.startswith("semifl") for label in labels), labels
    assert (run_dir / "plots" / "accuracy.png").stat().st_size > 1000


def test_plot_run_writes_both_pngs(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    rows = [{"round": 1, "bytes_up": 5, "bytes_down": 5, "test_acc": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = plot_run(run)
    assert [p.name for p in paths] == ["accuracy.png", "bytes.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_a_run_draws_its_plots_with_its_class_count_and_description(small_config, tmp_path, monkeypatch) -> None:
    """The runtime's plots know the dataset's classes (the chance line) and name the run's algorithm,
    dataset, model, runtime and seed; summary.json keeps the class count and runtime for later plots."""
    drawn_figs = {}
    for name in ("accuracy_figure", "bytes_figure"):
        real = getattr(tracking, name)

        def keep(*args, _real=real, _name=name, **kwargs):
            drawn_figs[_name] = _real(*args, **kwargs)
            return drawn_figs[_name]

        monkeypatch.setattr(tracking, name, keep)
    res = run_local(small_config("common_args.random_seed=3"), run_dir=tmp_path / "run")
    assert res.summary["num_classes"] == 10 and res.summary["runtime"] == "local"
    ax = drawn_figs["accuracy_figure"].axes[0]
    assert_accuracy_axis(ax, 10.0)
    assert ax.get_title() == "run: test accuracy\nfedavg_ssl on digits, cnn28-gn, local, seed 3"
    assert drawn_figs["bytes_figure"].get_suptitle().endswith("fedavg_ssl on digits, cnn28-gn, local, seed 3")
    plot_run(res.run_dir)  # again from the folder alone (as `fedml-ssfl run` does after the baselines)
    assert_accuracy_axis(drawn_figs["accuracy_figure"].axes[0], 10.0)
    assert drawn_figs["accuracy_figure"].axes[0].get_title() == ax.get_title()
