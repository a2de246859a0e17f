"""mingpt-torchrun (mingpt/cli/launch.py)."""

from mingpt.cli.launch import exit_code_of_signal


def test_the_launchers_exit_code_after_a_signal_is_the_workers():
    assert exit_code_of_signal(2, [130, 130]) == 130
    assert exit_code_of_signal(15, [75, 75]) == 75
    assert exit_code_of_signal(2, [130, 74]) == 74  # one rank's save failed: the snapshot is not there
    assert exit_code_of_signal(2, [-9, -9]) == 130  # the workers said nothing: the shell's 128 + signal
