"""deploy/kubernetes: the manifests are valid Kubernetes objects (checked
against the API schemas by kubernetes-validate, when installed), and the exact
commands, arguments and environment they give the dispatcher, the workers and
the trainer Job work: run as local processes (the downward API's pod IP and the
Services' names replaced by 127.0.0.1, each Secret's keys written as files at
its mount path's stand-in), a trainer reads a DYNAMIC epoch over TLS with the
auth token."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dataservice import _serverproc
from tests.tls_certs import make_certs

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
VALIDATE_ENV = "KUBERNETES_VALIDATE"
TOKEN = "deploy-test-token-0123456789"


def _docs() -> dict[str, dict]:
    """kind/name -> object, over every manifest."""
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def _validator() -> list[str] | None:
    """The kubernetes-validate command: $KUBERNETES_VALIDATE, else on PATH,
    else the module in this interpreter; None when there is none."""
    explicit = os.environ.get(VALIDATE_ENV)
    if explicit:
        return [explicit]
    found = shutil.which("kubernetes-validate")
    if found:
        return [found]
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "kubernetes_validate"]


def test_manifests_are_valid_kubernetes_objects():
    command = _validator()
    if command is None:
        pytest.skip(
            "kubernetes-validate is not installed (pip install 'dataservice[k8s]', or set "
            f"${VALIDATE_ENV} to its executable, e.g. /tmp/venv-k8s/bin/kubernetes-validate)"
        )
    assert MANIFESTS, "no manifests under deploy/kubernetes"
    proc = subprocess.run(
        [*command, "--strict", *map(str, MANIFESTS)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = proc.stdout.count(" passed ") + proc.stderr.count(" passed ")
    assert passed == len(_docs()), proc.stdout + proc.stderr


def test_manifests_wire_what_the_recipe_says():
    docs = _docs()
    dispatcher = docs["StatefulSet/dataservice-dispatcher"]
    args = dispatcher["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--fault-tolerant" in args and "--work-dir=/var/lib/dataservice" in args
    assert dispatcher["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "work-dir"
    assert docs["Service/dataservice-worker"]["spec"]["clusterIP"] == "None"
    worker = docs["Deployment/dataservice-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "--worker-address=$(POD_IP):5051" in worker["args"]
    pod_ip = next(e for e in worker["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for container in (worker, dispatcher["spec"]["template"]["spec"]["containers"][0]):
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        # A server with a certificate serves its metrics port over HTTPS only.
        tls = any(a.startswith("--tls-cert=") for a in container["args"])
        for probe in ("readinessProbe", "livenessProbe"):
            scheme = container[probe]["httpGet"].get("scheme", "HTTP")
            assert scheme == ("HTTPS" if tls else "HTTP"), (probe, container["args"])
        assert "--metrics-port=9090" in container["args"]
        assert container["resources"]["requests"]


# ------------------------------------------------------------- as processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pods:
    """Runs the manifests' containers as processes on this host."""

    def __init__(self, tmp: Path) -> None:
        certs = make_certs(str(tmp / "certs"))
        # The Secrets the manifests name, key -> content.
        self.secrets = {
            "dataservice-auth": {"token": TOKEN + "\n"},
            "dataservice-tls": {
                "ca.crt": Path(certs.ca).read_text(),
                "tls.crt": Path(certs.server_cert).read_text(),
                "tls.key": Path(certs.server_key).read_text(),
            },
        }
        self.tmp = tmp
        self.dispatcher_port = _free_port()
        self.procs: list[subprocess.Popen] = []
        self.outputs: dict[int, list[str]] = {}

    def _volumes(self, pod: dict, name: str) -> dict[str, str]:
        """mountPath -> a local directory holding what the volume would."""
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in pod.get("_claims", [])}
        out = {}
        for mount in pod["containers"][0].get("volumeMounts", []):
            local = self.tmp / name / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            volume = volumes.get(mount["name"])
            if volume is not None and "secret" in volume:
                secret = self.secrets[volume["secret"]["secretName"]]
                items = volume["secret"].get("items") or [{"key": k, "path": k} for k in secret]
                for item in items:
                    path = local / item["path"]
                    path.write_text(secret[item["key"]])
                    path.chmod(volume["secret"].get("defaultMode", 0o644) & 0o777)
            else:
                assert mount["name"] in claims or "emptyDir" in (volume or {}), mount
            out[mount["mountPath"]] = str(local)
        return out

    def _localize(self, text: str, mounts: dict[str, str], port_map: dict[str, str]) -> str:
        for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(mount, local)
        for service, port in (("dataservice-dispatcher:5050", self.dispatcher_port),):
            text = text.replace(service, f"127.0.0.1:{port}")
        for old, new in port_map.items():
            text = re.sub(rf"(?<=[:=]){old}\b", new, text)
        return text

    def start(self, pod: dict, name: str, port_map: dict[str, str]) -> subprocess.Popen:
        """Starts `pod`'s container with its command, args and env made local."""
        container = pod["containers"][0]
        mounts = self._volumes(pod, name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DATASERVICE_")}
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        k8s_env: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                value = self._localize(str(var["value"]), mounts, port_map)
            elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
                value = "127.0.0.1"
            else:
                ref = var["valueFrom"]["secretKeyRef"]
                value = self.secrets[ref["name"]][ref["key"]].strip()
            k8s_env[var["name"]] = value
        env.update(k8s_env)

        def expand(arg: str) -> str:  # Kubernetes' $(VAR) in command and args
            return re.sub(r"\$\((\w+)\)", lambda m: k8s_env.get(m.group(1), m.group(0)), arg)

        argv = [self._localize(expand(a), mounts, port_map) for a in container["command"]]
        argv += [self._localize(expand(a), mounts, port_map) for a in container.get("args", [])]
        if argv[0] == "dataservice":
            argv = [sys.executable, "-m", "dataservice", *argv[1:]]
        elif argv[0] == "python":
            argv[0] = sys.executable
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        lines: list[str] = []
        self.outputs[proc.pid] = lines
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        return proc

    def wait_ready(self, proc: subprocess.Popen, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        lines = self.outputs[proc.pid]
        while time.monotonic() < deadline:
            for line in list(lines):
                m = _serverproc.READY_RE.match(line)
                if m:
                    return m.group(2)
            if proc.poll() is not None:
                time.sleep(0.2)  # the reader thread's last lines
                raise AssertionError(f"exited {proc.returncode} before ready:\n{''.join(lines)}")
            time.sleep(0.05)
        raise AssertionError(f"not ready within {timeout_s} s:\n{''.join(lines)}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


def _wait_probe_ok(pod: dict, probe: str, port_map: dict[str, str], timeout_s: float) -> None:
    """Waits until `pod`'s HTTP `probe` answers 200 on this host (its named port
    mapped through `port_map`), as the kubelet's would."""
    container = pod["containers"][0]
    get = container[probe]["httpGet"]
    ports = {p["name"]: str(p["containerPort"]) for p in container["ports"]}
    port = port_map.get(ports.get(get["port"], str(get["port"])), str(get["port"]))
    scheme = get.get("scheme", "HTTP").lower()
    url = f"{scheme}://127.0.0.1:{port}{get['path']}"
    # The kubelet's HTTPS probes verify no certificate and present none.
    context = ssl._create_unverified_context() if scheme == "https" else None
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as answer:
                if answer.status == 200:
                    return
                last = f"status {answer.status}"
        except OSError as err:
            last = str(err)
        time.sleep(0.2)
    raise AssertionError(f"{probe} {url} not 200 within {timeout_s} s: {last}")


@pytest.mark.timeout(240)
def test_the_manifests_commands_serve_a_tls_dynamic_epoch(tmp_path):
    docs = _docs()
    pods = _Pods(tmp_path)
    try:
        statefulset = docs["StatefulSet/dataservice-dispatcher"]
        dispatcher_pod = dict(statefulset["spec"]["template"]["spec"])
        dispatcher_pod["_claims"] = statefulset["spec"]["volumeClaimTemplates"]
        dispatcher_ports = {"5050": str(pods.dispatcher_port), "9090": str(_free_port())}
        dispatcher = pods.start(dispatcher_pod, "dispatcher", dispatcher_ports)
        pods.wait_ready(dispatcher, 60)
        probed = [(dispatcher_pod, dispatcher_ports)]
        deployment = docs["Deployment/dataservice-worker"]
        workers = []
        for i in range(deployment["spec"]["replicas"]):
            # Pods have an IP each; here they share one, so each gets its own port.
            port_map = {"5051": str(_free_port()), "9090": str(_free_port())}
            workers.append(
                pods.start(deployment["spec"]["template"]["spec"], f"worker-{i}", port_map)
            )
            probed.append((deployment["spec"]["template"]["spec"], port_map))
        addresses = [pods.wait_ready(w, 60) for w in workers]
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses  # $(POD_IP)
        for pod, port_map in probed:  # the probes the kubelet would make
            for probe in ("readinessProbe", "livenessProbe"):
                _wait_probe_ok(pod, probe, port_map, 30)
        job = docs["Job/dataservice-trainer-example"]
        trainer = pods.start(job["spec"]["template"]["spec"], "trainer", {})
        assert trainer.wait(timeout=180) == 0, "".join(pods.outputs[trainer.pid])
        time.sleep(0.2)  # the reader thread's last lines
        out = "".join(pods.outputs[trainer.pid])
        assert "epoch of 10000 elements" in out, out
        for address in addresses:
            assert address in out, out  # both workers served the epoch
        # Fault tolerance on: the journal is in the claim's stand-in.
        assert any((tmp_path / "dispatcher" / "work-dir").iterdir())
    finally:
        pods.stop()
    for proc in pods.procs:
        text = "".join(pods.outputs[proc.pid])
        assert "travels in clear" not in text and "without TLS" not in text, text
