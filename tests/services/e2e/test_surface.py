"""Every service answers health checks; the internal ones server reflection, as operators' tools expect. The
public admission port serves no reflection unless started with --reflection (it would list every method to
anyone)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


@pytest.mark.parametrize("name, service", [
    ("coordinator", "tether.v1.Coordinator"),
    ("stage0", "tether.v1.Stage"),
    ("stage1", "tether.v1.Stage"),
])
def test_health_and_reflection(cluster, name, service):
    with grpc.insecure_channel(cluster.service(name).address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(ch)
        services = db.get_services()
        assert service in services and "grpc.health.v1.Health" in services
        methods = {m.name for m in DescriptorPool(db).FindServiceByName(service).methods}
        assert methods, "reflection serves the service's full descriptor, not just its name"


def test_public_port_has_health_but_no_reflection(cluster):
    with grpc.insecure_channel(cluster.target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="tether.v1.Admission"), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as off:
            ProtoReflectionDescriptorDatabase(ch).get_services()
        assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
