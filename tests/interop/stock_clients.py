"""Stock gRPC clients against wardend's Unix sockets, for tests/interop.rs.

Each client is used as a user would use it, with its defaults: nothing here
sets `:authority` or any channel option. Stubs are generated at run time
from the repository's proto/ with grpcio-tools (no generated code is kept
in the repository). Prints one JSON object: for each call, the gRPC status
code name it ended with, its details, and a short summary of the answer.

    stock_clients.py grpcio  SOCKET PROTO_DIR   every read RPC of
        warden.v1.Agent, grpc.health.v1 Check and Watch, reflection
        (v1alpha, through grpcio-reflection's descriptor database)
    stock_clients.py grpclib SOCKET PROTO_DIR   the same read RPCs and
        health Check through grpclib (an HTTP/2 stack of its own, the
        Python h2 library)
    stock_clients.py nvrx    SOCKET PROTO_DIR   nvhcd RunHealthCheck exactly
        as NVRx 0.7's NodeHealthCheck calls it (see nvrx_check below)
"""

import asyncio
import importlib
import json
import os
import sys
import tempfile

from grpc_tools import protoc


def generate(proto_dir, files, out):
    """Compiles `files` (relative to proto_dir) into `out` and imports it."""
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
    ] + files
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"grpc_tools.protoc failed ({rc}) on {files}")
    # Regular packages, so that the generated `warden.v1` is not shadowed
    # by the installed `warden` client package.
    for f in files:
        parts = os.path.dirname(f).split("/")
        for i in range(1, len(parts) + 1):
            init = os.path.join(out, *parts[:i], "__init__.py")
            open(init, "a").close()
    if out not in sys.path:
        sys.path.insert(0, out)


def message(pb2, name):
    """The message class `name` of warden.v1, whichever file declares it."""
    from google.protobuf.message_factory import GetMessageClass

    pool = pb2.DESCRIPTOR.pool
    return GetMessageClass(pool.FindMessageTypeByName(f"warden.v1.{name}"))


# (method, request message, request fields, cardinality): the read RPCs of
# warden.v1.Agent. Streams are read for their first message (WatchHealth
# sends the current state at once) or for their response headers (events
# and incidents arrive only when something happens).
READ_RPCS = [
    ("GetNodeHealth", "GetNodeHealthRequest", {}, "unary"),
    ("GetAgentInfo", "GetAgentInfoRequest", {}, "unary"),
    ("ListEvents", "ListEventsRequest", {"limit": 10}, "unary"),
    ("GetRanks", "GetRanksRequest", {}, "unary"),
    ("GetIncidents", "GetIncidentsRequest", {"limit": 10}, "unary"),
    ("GetStragglers", "GetStragglersRequest", {"job_id": "interop"}, "unary"),
    ("ListCheckpoints", "ListCheckpointsRequest", {}, "unary"),
    ("GetGoodput", "GetGoodputRequest", {"job_id": "interop"}, "unary"),
    ("WatchHealth", "WatchHealthRequest", {}, "first"),
    ("WatchEvents", "WatchEventsRequest", {}, "headers"),
    ("WatchIncidents", "WatchIncidentsRequest", {}, "headers"),
]

TIMEOUT = 30


def summary(msg):
    # Health answers: their component ids (what the test checks).
    if msg.DESCRIPTOR.name == "NodeHealth":
        return "components: " + ",".join(c.id for c in msg.components)
    text = str(msg).replace("\n", " ")
    return text[:200]


def run_grpcio(socket, proto_dir, out):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    generate(proto_dir, ["warden/v1/agent.proto", "warden/v1/checkpoint.proto"], out)
    pb2 = importlib.import_module("warden.v1.agent_pb2")
    pb2_grpc = importlib.import_module("warden.v1.agent_pb2_grpc")
    results = {}
    # grpcio's defaults: no options, so :authority is the percent-encoded
    # socket path.
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb2_grpc.AgentStub(channel)
        for method, req, fields, kind in READ_RPCS:
            request = message(pb2, req)(**fields)
            call = getattr(stub, method)
            try:
                if kind == "unary":
                    results[method] = ok(summary(call(request, timeout=TIMEOUT)))
                elif kind == "first":
                    stream = call(request, timeout=TIMEOUT)
                    results[method] = ok(summary(next(stream)))
                    stream.cancel()
                else:
                    stream = call(request, timeout=TIMEOUT)
                    stream.initial_metadata()
                    stream.cancel()
                    results[method] = ok("response headers received")
            except grpc.RpcError as e:
                results[method] = failed(e.code().name, e.details())

        health = health_pb2_grpc.HealthStub(channel)
        for service in ["", "warden.v1.Agent"]:
            name = f"health.Check({service or 'node'})"
            try:
                r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
                results[name] = ok(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
            except grpc.RpcError as e:
                results[name] = failed(e.code().name, e.details())
        try:
            stream = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
            r = next(stream)
            stream.cancel()
            results["health.Watch"] = ok(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
        except grpc.RpcError as e:
            results["health.Watch"] = failed(e.code().name, e.details())

        try:
            db = ProtoReflectionDescriptorDatabase(channel)
            services = sorted(db.get_services())
            desc = db.FindFileContainingSymbol("warden.v1.Agent")
            results["reflection.v1alpha"] = ok(
                {"services": services, "file": desc.name}
            )
        except grpc.RpcError as e:
            results["reflection.v1alpha"] = failed(e.code().name, e.details())
    return results


def run_grpclib(socket, proto_dir, out):
    import grpclib.client
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError
    from grpc_health.v1 import health_pb2

    generate(proto_dir, ["warden/v1/agent.proto", "warden/v1/checkpoint.proto"], out)
    pb2 = importlib.import_module("warden.v1.agent_pb2")
    results = {}

    async def main():
        channel = grpclib.client.Channel(path=socket)
        try:
            for method, req, fields, kind in READ_RPCS:
                request = message(pb2, req)(**fields)
                reply = pb2.DESCRIPTOR.services_by_name["Agent"].methods_by_name[method].output_type
                reply_cls = message(pb2, reply.name)
                cardinality = Cardinality.UNARY_UNARY if kind == "unary" else Cardinality.UNARY_STREAM
                try:
                    async with channel.request(
                        f"/warden.v1.Agent/{method}", cardinality, type(request), reply_cls,
                        timeout=TIMEOUT,
                    ) as stream:
                        await stream.send_message(request, end=True)
                        if kind == "headers":
                            await stream.recv_initial_metadata()
                            results[method] = ok("response headers received")
                            await stream.cancel()
                            continue
                        reply_msg = await stream.recv_message()
                        results[method] = ok(summary(reply_msg))
                        if kind == "first":
                            await stream.cancel()
                        else:
                            await stream.recv_trailing_metadata()
                except GRPCError as e:
                    results[method] = failed(e.status.name, e.message)
            try:
                async with channel.request(
                    "/grpc.health.v1.Health/Check", Cardinality.UNARY_UNARY,
                    health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse,
                    timeout=TIMEOUT,
                ) as stream:
                    await stream.send_message(health_pb2.HealthCheckRequest(service=""), end=True)
                    r = await stream.recv_message()
                    await stream.recv_trailing_metadata()
                    results["health.Check(node)"] = ok(
                        health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
            except GRPCError as e:
                results["health.Check(node)"] = failed(e.status.name, e.message)
        finally:
            channel.close()

    asyncio.run(asyncio.wait_for(main(), timeout=120))
    return results


def nvrx_check(target, pb2, pb2_grpc, grpc):
    """NodeHealthCheck._perform_health_check of nvidia-resiliency-ext v0.7.0
    (tag v0.7.0-main, commit 02ee37aa311759615cde88a4cda9831ff7830e46,
    src/nvidia_resiliency_ext/shared_utils/health_check.py), its call and
    its reading of the answer, with the logging left out. Returns
    (healthy, connectivity_error): NVRx treats an exception as healthy
    ("treating as healthy (skip)"), so the error is reported beside the
    verdict for the test to tell a real pass from a failed-open one.
    """
    request_timeout_sec = None
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb2_grpc.HealthCheckServiceStub(channel)
            request = pb2.HealthCheckRequest(args=["--no-slurm"])
            if request_timeout_sec is not None:
                response = stub.RunHealthCheck(request, timeout=request_timeout_sec)
            else:
                response = stub.RunHealthCheck(request)

            if not response.success:
                return False, None

            output = response.output
            try:
                result = json.loads(output)
                fail_count = result.get("fail_count")
                if fail_count is None:
                    return False, None
                if fail_count != 0:
                    return False, None
            except json.JSONDecodeError:
                return False, None
            return True, None
    except Exception as e:  # noqa: BLE001 - as NVRx does
        return True, str(e)


def run_nvrx(socket, proto_dir, out):
    import grpc

    generate(proto_dir, ["nvhcd/nvhcd.proto"], out)
    pb2 = importlib.import_module("nvhcd.nvhcd_pb2")
    pb2_grpc = importlib.import_module("nvhcd.nvhcd_pb2_grpc")
    # NVRx's _resolve_channel_target: a path starting with '/' becomes
    # unix://PATH.
    target = f"unix://{socket}"
    healthy, error = nvrx_check(target, pb2, pb2_grpc, grpc)
    return {"healthy": healthy, "connectivity_error": error}


def ok(what):
    return {"code": "OK", "summary": what}


def failed(code, details):
    return {"code": code, "details": details}


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("grpcio", "grpclib", "nvrx"):
        raise SystemExit(f"usage: {sys.argv[0]} grpcio|grpclib|nvrx SOCKET PROTO_DIR")
    client, socket, proto_dir = sys.argv[1:]
    with tempfile.TemporaryDirectory() as out:
        run = {"grpcio": run_grpcio, "grpclib": run_grpclib, "nvrx": run_nvrx}[client]
        print(json.dumps(run(socket, proto_dir, out)))


if __name__ == "__main__":
    main()
