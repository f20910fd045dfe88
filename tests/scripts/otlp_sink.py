"""An OTLP/HTTP profiles endpoint for the tests: it decodes each ExportProfilesServiceRequest with
the official `opentelemetry-proto` package and appends one JSON line per request to a file.

Usage: python otlp_sink.py READY_FILE OUT_FILE [--status CODE] [--message TEXT]

It listens on a free port of 127.0.0.1 and writes that port to READY_FILE once it accepts
requests. POSTs to /v1development/profiles (protobuf or JSON, gzip or not) are answered 200 with an
empty ExportProfilesServiceResponse; with --status, every request is answered CODE with a
google.rpc.Status carrying TEXT (what a collector refusing the data sends). Each JSON line holds:
  status, path, content_type, content_encoding, user_agent, headers (lower-case names)
  resources: [{attributes: {key: value}, profiles: [{sample_type: [type, unit],
      period_type: [type, unit], period, time_unix_nano, duration_nano,
      samples: [{thread_id, thread_name, attributes, values, count, events, timestamps_ok, stack}]}]}]
      (samples of the same thread and stack are merged: count is how many; values holds one
      number, the sum of all their values (a Sample carries one value per event it counts);
      events is how many timestamps they carry, timestamps_ok whether each Sample had as many
      timestamps as values (or none), in order, all within its profile's time)
  stack: frames leaf first, each {type, name, file, start_line, line}: `type` is the location's
      profile.frame.type attribute; a location with several lines gives several frames, its
      innermost (last) line first
  totals: {resources, samples, values}: samples is the number of Sample messages, values the sum of
      all their values
  error: set when the body could not be read or decoded
"""
import argparse
import gzip
import http.server
import json
import os
import sys
import threading

from google.protobuf import json_format
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as service

PATH = "/v1development/profiles"
# google.rpc.Code for the HTTP statuses a refusing collector answers.
RPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 413: 8, 429: 8, 500: 13, 502: 14, 503: 14, 504: 4}


def any_value(value):
    """An AnyValue as plain JSON."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


class Dictionary:
    """Reads the request's shared ProfilesDictionary; an index out of range is an error."""

    def __init__(self, d):
        self.d = d

    def string(self, index):
        return self.d.string_table[index]

    def attributes(self, indices):
        out = {}
        for i in indices:
            attribute = self.d.attribute_table[i]
            out[self.string(attribute.key_strindex)] = any_value(attribute.value)
        return out

    def frames(self, location_index):
        location = self.d.location_table[location_index]
        kind = self.attributes(location.attribute_indices).get("profile.frame.type")
        frames = []
        for line in reversed(location.lines):
            function = self.d.function_table[line.function_index]
            frames.append({"type": kind, "name": self.string(function.name_strindex),
                           "file": self.string(function.filename_strindex), "start_line": function.start_line,
                           "line": line.line})
        if not frames:
            frames.append({"type": kind, "name": None, "file": None, "start_line": 0, "line": 0, "address": location.address})
        return frames

    def stack(self, stack_index):
        frames = []
        for location_index in self.d.stack_table[stack_index].location_indices:
            frames.extend(self.frames(location_index))
        return frames

    def value_type(self, value_type):
        return [self.string(value_type.type_strindex), self.string(value_type.unit_strindex)]


def summarize(request):
    dictionary = Dictionary(request.dictionary)
    totals = {"resources": 0, "samples": 0, "values": 0}
    resources = []
    for resource_profiles in request.resource_profiles:
        totals["resources"] += 1
        profiles = []
        for scope_profiles in resource_profiles.scope_profiles:
            for profile in scope_profiles.profiles:
                merged = {}
                for sample in profile.samples:
                    totals["samples"] += 1
                    value = sum(sample.values)
                    totals["values"] += value
                    times = list(sample.timestamps_unix_nano)
                    end = profile.time_unix_nano + profile.duration_nano
                    timestamps_ok = (not times or len(times) == len(sample.values)) and times == sorted(times) \
                        and all(profile.time_unix_nano <= t <= end for t in times)
                    attributes = dictionary.attributes(sample.attribute_indices)
                    stack = dictionary.stack(sample.stack_index)
                    key = json.dumps([attributes, stack], sort_keys=True)
                    entry = merged.get(key)
                    if entry is None:
                        merged[key] = {"thread_id": attributes.get("thread.id"), "thread_name": attributes.get("thread.name"),
                                       "attributes": attributes, "values": [value], "count": 1, "events": len(times),
                                       "timestamps_ok": timestamps_ok, "stack": stack}
                    else:
                        entry["count"] += 1
                        entry["values"][0] += value
                        entry["events"] += len(times)
                        entry["timestamps_ok"] = entry["timestamps_ok"] and timestamps_ok
                profiles.append({"sample_type": dictionary.value_type(profile.sample_type),
                                 "period_type": dictionary.value_type(profile.period_type), "period": profile.period,
                                 "time_unix_nano": profile.time_unix_nano, "duration_nano": profile.duration_nano,
                                 "attributes": dictionary.attributes(profile.attribute_indices),
                                 "samples": list(merged.values())})
        attributes = {kv.key: any_value(kv.value) for kv in resource_profiles.resource.attributes}
        resources.append({"attributes": attributes, "profiles": profiles})
    return {"resources": resources, "totals": totals}


def rpc_status(code, message):
    """A google.rpc.Status {code, message}, encoded by hand (its package is not a dependency)."""
    def varint(n):
        out = bytearray()
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)
    text = message.encode()
    return b"\x08" + varint(code) + b"\x12" + varint(len(text)) + text


def read_body(handler):
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int(handler.rfile.readline().split(b";")[0], 16)
            chunk = handler.rfile.read(size)
            handler.rfile.readline()
            if size == 0:
                return bytes(body)
            body.extend(chunk)
    return handler.rfile.read(int(handler.headers.get("Content-Length", "0")))


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    lock = threading.Lock()
    out = None
    status = 200
    message = ""

    def log_message(self, format, *args):
        pass

    def do_POST(self):
        record = {"status": self.status, "path": self.path, "content_type": self.headers.get("Content-Type"),
                  "content_encoding": self.headers.get("Content-Encoding"), "user_agent": self.headers.get("User-Agent"),
                  "headers": {name.lower(): value for name, value in self.headers.items()}}
        json_body = (record["content_type"] or "").startswith("application/json")
        try:
            body = read_body(self)
            if (record["content_encoding"] or "").lower() == "gzip":
                body = gzip.decompress(body)
            request = service.ExportProfilesServiceRequest()
            if json_body:
                json_format.Parse(body, request)
            else:
                request.ParseFromString(body)
            record.update(summarize(request))
        except Exception as error:  # noqa: BLE001 - any bad body is recorded, and answered 400
            record["error"] = f"{type(error).__name__}: {error}"
            if record["status"] == 200:
                record["status"] = 400
        if self.path != PATH:
            record["status"] = 404
        # Written before the answer: once the sender has its answer, the line is there.
        with self.lock:
            with open(self.out, "a") as out:
                out.write(json.dumps(record) + "\n")
        self.answer(record)

    def answer(self, record):
        status = record["status"]
        if status == 200:
            reply = service.ExportProfilesServiceResponse()
            body = json_format.MessageToJson(reply).encode() if record["content_type"] == "application/json" else reply.SerializeToString()
        else:
            message = self.message or record.get("error") or f"no profiles endpoint at {self.path}"
            body = rpc_status(RPC_CODES.get(status, 2), message)
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if record["content_type"] == "application/json" and status == 200
                         else "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("ready")
    parser.add_argument("out")
    parser.add_argument("--status", type=int, default=200)
    parser.add_argument("--message", default="")
    args = parser.parse_args()
    Sink.out, Sink.status, Sink.message = args.out, args.status, args.message
    open(args.out, "a").close()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    server.daemon_threads = True
    with open(args.ready + ".tmp", "w") as ready:
        ready.write(f"{server.server_address[1]}\n")
    os.rename(args.ready + ".tmp", args.ready)
    sys.stdout.flush()
    server.serve_forever()


main()
