"""A warm ClientApp worker for a SuperNode started with ``--isolation process`` (flwr 1.40-1.41).

With Flower's default isolation (``subprocess``) a SuperNode starts ``flower-superexec``, which polls the
SuperNode's Runtime API every second (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``) and launches a fresh
``flwr-clientapp`` process for every message: each message pays a Python start-up, ``import torch``, the
installation of the app bundle and whatever the ClientApp builds (fedfuse: the node's data and model).  In
``--isolation process`` mode the SuperNode launches nothing and waits for an external process to claim its
tasks.  This module is that process, long-running: it claims each ClientApp task from the Runtime API
(``AcquireTask``, the call ``flower-superexec`` makes) and runs it **in this process**, with Flower's own
task functions (``pull_task_input``, ``push_message``, ``push_task_output`` of ``flwr-clientapp``).  The app
bundle is installed and the ``ClientApp`` loaded once per bundle, so torch, the app module and the
ClientApp's caches (fedfuse's node data and algorithm) stay warm across messages.

Run one per SuperNode, next to it::

    flower-supernode ... --isolation process --port 9094
    python -m fedfuse.flower.worker --runtime-api-address 127.0.0.1:9094

It serves fedfuse's app only (a bundle whose ClientApp is not fedfuse's, or that carries code, gets an error
reply; ``--any-app`` serves any Flower app), one task at a time, as ``flwr-clientapp`` does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("fedfuse")

DEFAULT_POLL = 0.02  # seconds between two AcquireTask calls while idle (a loopback HTTP request: cheap)
#: Seconds a task may spend pulling its message's objects before it fails.  Flower's own default (2 hours, 500
#: tries per object) is for a ``flwr-clientapp`` process the SuperNode kills when its run ends; a warm worker is
#: never killed, so a task whose run died under it (a SuperLink crash mid-round: the objects never become
#: available, the SuperLink answers "Run is finished") would keep it from every later task for that long.
DEFAULT_PULL_TIMEOUT = 60.0


class WarmWorker:
    """Claims the ClientApp tasks of one SuperNode's Runtime API and runs them in this process."""

    def __init__(self, runtime_api_address: str, *, insecure: bool = True, root_certificates: bytes | None = None,
                 poll: float = DEFAULT_POLL, any_app: bool = False,
                 pull_timeout: float = DEFAULT_PULL_TIMEOUT) -> None:
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient

        self.address = runtime_api_address
        self.insecure = insecure
        self.root_certificates = root_certificates
        self.poll = poll
        self.pull_timeout = pull_timeout
        self.any_app = any_app  # False: only fedfuse's app bundles (fedfuse.flower.deploy.check_fedfuse_bundle)
        self.apps: dict[str, Any] = {}  # fab hash -> loaded ClientApp
        self.tasks = 0
        self._acquire = RuntimeHttpClient.from_server_address(
            server_address=runtime_api_address, insecure=insecure, root_certificates=root_certificates,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
            retry_invoker=make_simple_http_retry_invoker())

    def acquire(self) -> str | None:
        """One ``AcquireTask`` call: the token of a pending ClientApp task, or ``None``."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType

        res = self._acquire.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
        return str(res.token) if res.HasField("task") and res.token else None

    def client_app(self, fab: Any, run: Any) -> Any:
        """The bundle's ClientApp, installed and loaded on first use, then reused."""
        app = self.apps.get(fab.hash_str)
        if app is None:
            if not self.any_app:
                from fedfuse.flower.deploy import check_fedfuse_bundle

                check_fedfuse_bundle(fab.content)
            from flwr.cli.install import install_from_fab
            from flwr.clientapp.utils import get_load_client_app_fn

            install_from_fab(fab.content, skip_prompt=True)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            app = self.apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        return app

    def run_task(self, token: str) -> None:
        """Run one claimed task: pull its message and context, call the ClientApp, push the reply and status
        (an exception becomes Flower's error reply, as in ``flwr-clientapp``; the worker keeps serving)."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        client = RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=self.insecure, root_certificates=self.root_certificates,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                          RuntimeTokenHttpInterceptor(token)],
            retry_invoker=make_simple_http_retry_invoker())
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message = context = reply = None
        status, details = SubStatus.FAILED, "ClientApp task failed"
        t0 = time.perf_counter()
        t1 = t2 = t0
        try:
            message, context, run, fab = pull_task_input(client, self.pull_timeout)
            app = self.client_app(fab, run)
            t1 = time.perf_counter()
            reply = app(message=message, context=context)
            t2 = time.perf_counter()
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:
            log.error("ClientApp raised an exception: %s", ex, exc_info=ex)
            details = f"{type(ex)}:<'{ex}'>"
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                                reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            except Exception as ex:
                log.error("failed to push the reply: %s", ex)
            push_task_output(client=client, context=context, sub_status=status, details=details)
            heartbeat.stop()
            client.close()
            self.tasks += 1
            t3 = time.perf_counter()
            stats = os.environ.get("FEDFUSE_WORKER_STATS")
            if stats:  # where a task's time went: pulling its input, the ClientApp, pushing the reply and status
                with open(stats, "a") as fh:
                    fh.write(json.dumps({"time": time.time(), "type": message.metadata.message_type if message
                                         else None, "pull": t1 - t0, "app": t2 - t1, "push": t3 - t2}) + "\n")

    def serve(self, max_tasks: int | None = None, idle_exit: float | None = None) -> int:
        """Claim and run tasks until ``max_tasks`` ran or nothing came for ``idle_exit`` seconds; returns the
        number of tasks run."""
        last = time.monotonic()
        while max_tasks is None or self.tasks < max_tasks:
            token = self.acquire()
            if token is not None:
                self.run_task(token)
                last = time.monotonic()
                continue
            if idle_exit is not None and time.monotonic() - last > idle_exit:
                break
            time.sleep(self.poll)
        return self.tasks


def pull_task_input(client: Any, max_time: float) -> tuple[Any, Any, Any, Any]:
    """Flower's ``run_clientapp.pull_task_input`` (flwr 1.40-1.41: context, run and bundle, then the message's
    objects) with the objects' pull bounded by ``max_time`` seconds: past it the task fails
    (:class:`~flwr.supercore.inflatable.inflatable_utils.ObjectPullError` or a timeout) and the worker serves the
    next one."""
    from flwr.supernode.runtime import run_clientapp as rc  # Flower's own building blocks of the same function

    res = client.PullTaskInput(rc.PullTaskInputRequest())
    identity = getattr(rc, "TaskIdentity", None)
    if identity is not None:  # what Flower's own log lines of the task report
        identity.task_id, identity.run_id, identity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context, run, fab = rc.context_from_proto(res.context), rc.run_from_proto(res.run), rc.fab_from_proto(res.fab)
    msgs = client.PullMessages(rc.PullAppMessagesRequest())
    if not msgs.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = rc.Node(node_id=context.node_id)
    tree = msgs.message_object_trees[0]
    message = rc.pull_and_inflate_object_from_tree(
        tree, rc.make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        rc.make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=rc.Message, max_time=max_time)
    message.metadata.__dict__["_message_id"] = tree.object_id  # the deflated message lacks its own id
    return message, context, run, fab


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedfuse.flower.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                   help="the SuperNode's Runtime API (its --port; default %(default)s)")
    p.add_argument("--root-certificates", default=None,
                   help="CA of the Runtime API's TLS certificate (omit for the plain loopback API)")
    p.add_argument("--poll", type=float, default=DEFAULT_POLL, help="seconds between task polls while idle")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the SuperNode) exits")
    p.add_argument("--any-app", action="store_true", help="run any Flower app's ClientApp (default: fedfuse's only)")
    p.add_argument("--pull-timeout", type=float, default=DEFAULT_PULL_TIMEOUT,
                   help="seconds a task may spend pulling its message before it fails (default %(default)s)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    audit = os.environ.get("FEDFUSE_AUDIT_OPEN")
    if audit:  # record every file this process opens (tests check a node reads only its own data)
        sink = open(audit, "a", buffering=1)  # noqa: SIM115  (open for the life of the process)

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
                sink.write(os.fsdecode(args[0]) + "\n")

        sys.addaudithook(hook)
    if args.parent_pid is not None:
        from flwr.supercore.app_utils import start_parent_process_monitor

        start_parent_process_monitor(args.parent_pid)
    certs = None
    if args.root_certificates:
        with open(args.root_certificates, "rb") as fh:
            certs = fh.read()
    import torch  # paid once, before the first task

    torch.set_num_threads(int(os.environ.get("FEDFUSE_THREADS", "1")))
    worker = WarmWorker(args.runtime_api_address, insecure=certs is None, root_certificates=certs, poll=args.poll,
                         any_app=args.any_app, pull_timeout=args.pull_timeout)
    log.info("warm ClientApp worker serving %s (pid %d)", args.runtime_api_address, os.getpid())
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
