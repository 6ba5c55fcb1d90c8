"""Test tiers by cost: which marker a test gets, read from the fixtures it asks for.

``tests/conftest.py`` applies these before ``-m``/``-k`` deselect anything, so ``-m pure``
(``make test-fast``) selects exactly the tests that need no cluster, no Airflow, no tracking
server and no training run. A test whose cost does not show in its fixtures (it calls
``tests.support.cluster`` or trains in-process by itself) carries the marker in its module.
"""

from __future__ import annotations

from collections.abc import Iterable

# Cost markers, cheapest last. Every one is registered in pyproject.toml (a test checks it).
CLUSTER = "cluster"
AIRFLOW = "airflow"
SERVERS = "servers"
TRAINING = "training"
COSTLY = (CLUSTER, AIRFLOW, SERVERS, TRAINING)
PURE = "pure"
# Not a cost but a hazard: the test stops or changes what every other test uses (slurmdbd,
# sshd, a node, the login shell). ``make test`` runs these alone, after the rest
# (tests/lanes.py); tests/test_lanes.py checks that every test calling one of
# DISRUPTIVE_CALLS carries the marker.
DISRUPTIVE = "disruptive"
DISRUPTIVE_CALLS = frozenset({
    "restart_cluster_services", "stop_slurmdbd", "drop_sshd", "login_banner",
    "set_node_state", "cut_node_link", "set_node_down",
})
# A lesser hazard: the test sets down or cuts off only the nodes of the cluster's ``faults``
# partition, which nothing else uses (tests/support/cluster.py: FAULT_PARTITION). ``make test``
# runs these beside the rest, in a lane of their own; the same check accepts either marker.
FAULT_NODES = "fault_nodes"
HAZARD_MARKERS = frozenset({DISRUPTIVE, FAULT_NODES})
# Command words that disrupt the cluster when a test runs them itself.
DISRUPTIVE_COMMANDS = ("scontrol update", "nodename=", "ip link set")

# Fixture -> the cost it brings. item.fixturenames is the closure, so a fixture built on one of
# these (e.g. mlflow_client on mlflow_server) is covered by its base.
FIXTURE_TIERS: dict[str, str] = {
    "local_cluster": CLUSTER,
    "dags_test_env": AIRFLOW,
    "standalone": AIRFLOW,
    "servers": SERVERS,
    "moto_s3": SERVERS,
    "uncut": TRAINING,
    "sigterm_job": TRAINING,
    "config_for": TRAINING,
    "trained": TRAINING,
}

# The fixtures that need the session's MLflow + moto S3 stack booted (tests/conftest.py).
STACK_FIXTURE = "servers"


def tiers_of(fixturenames: Iterable[str], markers: Iterable[str]) -> set[str]:
    """The cost markers a test gets: its own plus those of its fixtures; ``pure`` if none."""
    found = {m for m in markers if m in COSTLY}
    found |= {FIXTURE_TIERS[f] for f in fixturenames if f in FIXTURE_TIERS}
    return found or {PURE}


# --- A pure test that reaches the cluster fails at once ---------------------------------------
# Its tier is read from its fixtures; one that calls tests.support.cluster (or runs sacct, ssh)
# without them would count as pure and pass here only because this machine has a cluster. The
# audit hook (tests/conftest.py) refuses those processes and connections while a pure test runs.
CLUSTER_COMMANDS = frozenset({"ssh", "sftp", "scp", "sacct", "sacctmgr", "squeue", "sbatch",
                              "scancel", "scontrol", "sinfo", "srun"})


class PureGuard:
    def __init__(self) -> None:
        self.active = False
        self._ssh_port: int | None = None

    def ssh_port(self) -> int | None:
        if self._ssh_port is None:
            from tests.support import cluster

            try:
                self._ssh_port = int(cluster.connection()["port"])
            except (cluster.ClusterNotUp, KeyError, ValueError):
                self._ssh_port = -1
        return self._ssh_port

    def __call__(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "subprocess.Popen":
            argv = args[1]
            first = argv.split()[0] if isinstance(argv, str) else str(list(argv)[0])
            name = first.rsplit("/", 1)[-1]
            if name in CLUSTER_COMMANDS or "local_cluster.sh" in " ".join(map(str, argv)):
                raise RuntimeError(f"a pure test ran {name}: give it the local_cluster fixture "
                                   "or the cluster marker")
        elif event == "socket.connect":
            address = args[1]
            if isinstance(address, tuple) and len(address) >= 2:
                self.active = False  # ssh_port() itself reads a file, not the network
                try:
                    port = self.ssh_port()
                finally:
                    self.active = True
                if address[1] == port:
                    raise RuntimeError("a pure test connected to the cluster's sshd: give it "
                                       "the local_cluster fixture or the cluster marker")


GUARD = PureGuard()
