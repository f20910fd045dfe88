"""Sends one known ExportProfilesServiceRequest over OTLP/HTTP, built with the official
`opentelemetry-proto` package: the tests' check that a collector and the sink behind it pass a
profile through whole.

Usage: python otlp_send.py URL PID [--ca CA_FILE]

The profile: one resource (process.pid PID, service.name otlp-send), samples/count, one sample of
thread PID named `sender` with value 7 and the stack (leaf first) `leaf_k` (kernel), `native_fn`
(native), `py_fn` (cpython, send.py:12, its function starting at line 10). Exits 0 once answered
200 with an ExportProfilesServiceResponse that rejects nothing."""
import argparse
import ssl
import time
import urllib.request

from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as service
from opentelemetry.proto.common.v1 import common_pb2 as common
from opentelemetry.proto.profiles.v1development import profiles_pb2 as pb


def request(pid):
    d = pb.ProfilesDictionary()
    strings = ["", "samples", "count", "profile.frame.type", "kernel", "native", "cpython", "leaf_k", "native_fn", "py_fn",
               "send.py", "thread.id", "thread.name", "cpu", "nanoseconds"]
    d.string_table.extend(strings)
    s = strings.index
    d.mapping_table.add()
    d.link_table.add()
    d.function_table.add()
    d.attribute_table.add()
    for kind in ["kernel", "native", "cpython"]:
        d.attribute_table.add(key_strindex=s("profile.frame.type"), value=common.AnyValue(string_value=kind))
    d.attribute_table.add(key_strindex=s("thread.id"), value=common.AnyValue(int_value=pid))
    d.attribute_table.add(key_strindex=s("thread.name"), value=common.AnyValue(string_value="sender"))
    d.location_table.add()
    for index, (name, file, start, line) in enumerate([("leaf_k", "", 0, 0), ("native_fn", "", 0, 0), ("py_fn", "send.py", 10, 12)]):
        d.function_table.add(name_strindex=s(name), system_name_strindex=s(name), filename_strindex=s(file), start_line=start)
        d.location_table.add(address=0x1000 * (index + 1), attribute_indices=[index + 1], lines=[pb.Line(function_index=index + 1, line=line)])
    d.stack_table.add()
    d.stack_table.add(location_indices=[1, 2, 3])
    req = service.ExportProfilesServiceRequest(dictionary=d)
    resource_profiles = req.resource_profiles.add()
    resource_profiles.resource.attributes.add(key="process.pid", value=common.AnyValue(int_value=pid))
    resource_profiles.resource.attributes.add(key="service.name", value=common.AnyValue(string_value="otlp-send"))
    profile = resource_profiles.scope_profiles.add().profiles.add()
    profile.sample_type.CopyFrom(pb.ValueType(type_strindex=s("samples"), unit_strindex=s("count")))
    profile.period_type.CopyFrom(pb.ValueType(type_strindex=s("cpu"), unit_strindex=s("nanoseconds")))
    profile.period = 10_101_010
    profile.time_unix_nano = time.time_ns() - 1_000_000_000
    profile.duration_nano = 1_000_000_000
    profile.samples.add(stack_index=1, attribute_indices=[4, 5], values=[7])
    return req


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("pid", type=int)
    parser.add_argument("--ca")
    args = parser.parse_args()
    context = ssl.create_default_context(cafile=args.ca) if args.ca else None
    body = request(args.pid).SerializeToString()
    post = urllib.request.Request(args.url.rstrip("/") + "/v1development/profiles", data=body, method="POST",
                                  headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(post, timeout=10, context=context) as answer:
        reply = service.ExportProfilesServiceResponse.FromString(answer.read())
        assert answer.status == 200 and reply.partial_success.rejected_profiles == 0, (answer.status, reply)


main()
