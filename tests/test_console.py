"""The console of `sse-rl run` (pipeline/console.py) without Ray: the lines it derives from the run directory, and
the redirection that sends everything else to the stage log. tests/test_pipeline.py checks a whole run's console."""
import io
import os
import subprocess
import sys
import time

from pipeline.console import Console, step_line
from pipeline.rundir import RunDir


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_step_lines():
    first = {"step": 2, "time": 10.0, "loss": 1.23456, "learning_rate": 1.5e-3, "num_tokens": 1000}
    second = {"step": 4, "time": 12.0, "loss": 1.0, "learning_rate": 1e-3, "num_tokens": 5000}
    assert step_line("sft", first, None, 6) == "[sft] step 2/6  loss 1.2346  lr 1.50e-03"
    assert step_line("sft", second, first, 6) == "[sft] step 4/6  loss 1.0000  lr 1.00e-03  2,000 tokens/s"
    grpo = {"step": 3, "time": 1.0, "reward": 0.5, "rewards/math_accuracy/mean": 0.5, "rewards/format/mean": 1.0,
            "vllm_parity": 2e-7, "sampling/kl_rollout_trainer": 3e-6, "kl": 0.01, "clip_ratio/region_mean": 0.0,
            "completions/mean_length": 76.4, "step_time": 5.12}
    assert step_line("grpo", grpo, None, 40) == ("[grpo] step 3/40  reward 0.500 (math_accuracy 0.500, format 1.000)"
                                                 "  parity 2.0e-07  rollout_kl 3.0e-06  kl 0.0100  clip 0.000"
                                                 "  length 76  5.1 s/step")
    # not steps: the trainer's summary row, GRPO's prompt count, eval results
    assert step_line("sft", {"step": 6, "train_runtime": 3.0}, None, 6) is None
    assert step_line("grpo", {"step": 0, "prompts": 200}, None, 40) is None


def test_follow_prints_steps_and_attempts_and_draws_a_bar_on_a_terminal(tmp_path):
    run = RunDir(tmp_path)
    run.create()
    run.stage_dir("sft").mkdir()
    run.log_metrics("init", 0, {"seconds": 1})  # before the stage: not news
    stream = Terminal()
    console = Console(stream)
    log = run.logs_dir / "sft.log"
    with console.follow(log, run, "sft"):
        run.write_progress("sft", done=2, total=6, unit="step", attempt="1@a", resumed_from="checkpoint-2")
        run.log_metrics("sft", 3, {"loss": 2.0, "learning_rate": 1e-3})
        time.sleep(1.2)
        run.drop_metrics_after("sft", 2)  # a restarted worker rewrites the file; its rows are logged again
        run.write_progress("sft", done=2, total=6, unit="step", attempt="2@a", resumed_from="checkpoint-2")
        run.log_metrics("sft", 3, {"loss": 2.5, "learning_rate": 1e-3})
    text = stream.getvalue()
    lines = [line for line in text.replace("\r", "\n").splitlines()
             if line.startswith(("[sft] resuming", "[sft] step"))]
    assert lines == ["[sft] resuming from checkpoint-2", "[sft] step 3/6  loss 2.0000  lr 1.00e-03",
                     "[sft] resuming from checkpoint-2", "[sft] step 3/6  loss 2.5000  lr 1.00e-03"], text
    assert "2/6" in text  # the bar


def test_no_bar_and_no_log_copy_when_not_asked(tmp_path):
    run = RunDir(tmp_path)
    run.create()
    run.stage_dir("sft").mkdir()
    stream, verbose = io.StringIO(), io.StringIO()
    log = run.logs_dir / "sft.log"
    with Console(stream).follow(log, run, "sft"), Console(verbose, verbose=True).follow(log):
        run.write_progress("sft", done=1, total=6, unit="step", attempt="1@a", resumed_from=None)
        log.write_text("library noise\n")
    assert stream.getvalue() == "" and verbose.getvalue() == "library noise\n"


def test_output_to_sends_file_descriptors_to_the_log(tmp_path):
    """Python, C-level writes and child processes all land in the log; the console stream stays on stdout."""
    code = ("import os, subprocess, sys; from pipeline.console import Console, output_to\n"
            "console = Console.of_stdout()\n"
            f"with output_to({str(tmp_path / 'stage.log')!r}):\n"
            "    print('python'); os.write(2, b'c level\\n'); subprocess.run(['echo', 'child'])\n"
            "    console.line('[sft] starting')\n"
            "print('after')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.stdout == "[sft] starting\nafter\n" and out.stderr == ""
    assert sorted((tmp_path / "stage.log").read_text().splitlines()) == ["c level", "child", "python"]
