"""A replay's progress when stdout is not a terminal (a pipe, a log): a line at the start, one
every few seconds while the figures change, and the last figures at the end -- not one line and
then only the summary (fedapp/replay/render.py)."""

from __future__ import annotations

import io

from fedapp.cli.text import CliConsole
from fedapp.replay.driver import Progress
from fedapp.replay.render import PLAIN_EVERY_S, progress_display


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pipe_gets_a_line_every_few_seconds_while_figures_change_and_the_last_figures():
    out, clock, p = io.StringIO(), _Clock(), Progress()
    p.total = 100
    with progress_display(CliConsole(file=out), enabled=False, clock=clock) as update:
        for second in range(31):  # 30 s of a replay, updated 4 times a second as the driver does
            for _ in range(4):
                clock.now += 0.25
                p.submitted = min(100, second * 4)
                update(p)
        p.finished = 97  # the last update before the summary, within PLAIN_EVERY_S of the previous line
        update(p)
    lines = out.getvalue().splitlines()
    assert PLAIN_EVERY_S <= 5
    assert 30 / PLAIN_EVERY_S - 1 <= len(lines) <= 30 / PLAIN_EVERY_S + 2, lines
    assert lines[0].endswith("submitted 0/100, running 0, finished 0, failed 0, cancelled 0, rejected 0, unplaceable 0")
    assert "submitted 100/100" in lines[-1] and "finished 97" in lines[-1]


def test_unchanged_figures_are_not_repeated_and_quiet_prints_nothing():
    out, clock, p = io.StringIO(), _Clock(), Progress()
    with progress_display(CliConsole(file=out), enabled=False, clock=clock) as update:
        for _ in range(100):
            clock.now += 1
            update(p)
    assert len(out.getvalue().splitlines()) == 1
    quiet = io.StringIO()
    with progress_display(CliConsole(file=quiet), enabled=False, quiet=True, clock=clock) as update:
        update(p)
    assert quiet.getvalue() == ""
