"""core.switch.ThreadSwitch: scoped, nesting, and per thread."""

import threading

from minifloat.core.switch import ThreadSwitch


def test_scoped_and_nesting_restores():
    switch = ThreadSwitch()
    assert not switch
    with switch.on():
        assert switch
        with switch.on():
            assert switch
        assert switch  # the inner block restores "on", not "off"
    assert not switch


def test_other_threads_do_not_see_it():
    switch, seen = ThreadSwitch(), []
    with switch.on():
        worker = threading.Thread(target=lambda: seen.append(bool(switch)))
        worker.start()
        worker.join()
    assert seen == [False]
