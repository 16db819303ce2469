"""daemon/cli/nodewatch.py against the API stand-in (tests/kube_api.py, a real HTTP server):
cordon -> drain once, uncordon -> uncordon once, failures retried at the next poll, the token
re-read on every call, usage errors exit 2. The whole path with real agents is
tests/integration/test_k8s_drain.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.cli import nodewatch
from daemon.cli.nodewatch import ApiError, NodeApi, Watcher
from tests.kube_api import FakeNodeApi, serving

pytestmark = pytest.mark.unit

NODE = "gpu-node-1"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeNodeApi, NodeApi]]:
    fake = FakeNodeApi("t0k3n", {NODE: False, "other": True})
    token = tmp_path / "token"
    token.write_text("t0k3n\n")
    with serving(fake):
        yield fake, NodeApi(fake.url, token, None)


class Ctl:
    def __init__(self, codes: list[int] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.codes = codes or []

    def __call__(self, argv: list[str]) -> int:
        self.calls.append(argv)
        return self.codes.pop(0) if self.codes else 0


def test_a_cordon_drains_once_and_an_uncordon_uncordons_once(api) -> None:
    fake, node_api = api
    ctl = Ctl()
    watcher = Watcher(node_api, NODE, ctl)
    watcher.poll()
    watcher.poll()
    assert ctl.calls == [], "a schedulable node is left alone"
    fake.set_cordoned(NODE, True)
    watcher.poll()
    watcher.poll()
    assert ctl.calls == [["drain", NODE]]
    fake.set_cordoned(NODE, False)
    watcher.poll()
    watcher.poll()
    assert ctl.calls == [["drain", NODE], ["uncordon", NODE]]
    assert fake.requests == [(f"/api/v1/nodes/{NODE}", 200)] * 6


def test_a_failed_call_is_retried_at_the_next_poll(api) -> None:
    fake, node_api = api
    fake.set_cordoned(NODE, True)
    ctl = Ctl(codes=[3, 0])  # no agent reachable, then the drain goes through
    watcher = Watcher(node_api, NODE, ctl)
    watcher.poll()
    assert watcher.drained is not True
    watcher.poll()
    watcher.poll()
    assert ctl.calls == [["drain", NODE], ["drain", NODE]] and watcher.drained is True


def test_a_restarted_watcher_drains_a_cordoned_node_and_leaves_others_alone(api) -> None:
    fake, node_api = api
    ctl = Ctl()
    Watcher(node_api, "other", ctl).poll()  # cordoned at start: the pod restarted on it
    assert ctl.calls == [["drain", "other"]]
    schedulable = Watcher(node_api, NODE, ctl)
    schedulable.poll()  # it cannot know it drained before: an operator's drain stays
    assert ctl.calls == [["drain", "other"]] and schedulable.drained is False


def test_api_errors_name_the_cause_and_the_token_is_reread(api, tmp_path: Path) -> None:
    fake, node_api = api
    (tmp_path / "token").write_text("rotated\n")
    with pytest.raises(ApiError, match="HTTP 401"):
        node_api.unschedulable(NODE)
    fake.token = "rotated"
    assert node_api.unschedulable(NODE) is False
    with pytest.raises(ApiError, match="HTTP 404"):
        node_api.unschedulable("nowhere")
    closed = NodeApi("http://127.0.0.1:9", tmp_path / "token", None)
    with pytest.raises(ApiError, match="GET node"):
        closed.unschedulable(NODE)


def test_usage_errors_exit_2(monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert nodewatch.main(["--node", NODE]) == 2
    assert "KUBERNETES_SERVICE_HOST" in capsys.readouterr().err
    assert nodewatch.main(["--node", NODE, "--api-url", "http://x", "--interval", "0"]) == 2
    assert nodewatch.main([]) == 2
