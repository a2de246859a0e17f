import threading
import time

from mingpt.training.watchdog import Watchdog


def test_watchdog_fires_when_steps_stop_and_names_the_rank():
    fired = []
    done = threading.Event()
    dog = Watchdog(0.3, "rank 1 (node7:0)", on_hang=lambda msg: (fired.append(msg), done.set()), poll_s=0.05)
    dog.start()
    for step in range(1, 6):  # steady progress: no alarm
        time.sleep(0.1)
        dog.beat(step)
    assert fired == []
    assert done.wait(2.0)  # then nothing for longer than the timeout
    dog.stop()
    assert "rank 1 (node7:0) made no progress" in fired[0] and "after step 5" in fired[0]


def test_disabled_watchdog_never_fires():
    fired = []
    dog = Watchdog(0, "rank 0", on_hang=fired.append, poll_s=0.01).start()
    time.sleep(0.1)
    dog.stop()
    assert fired == []
