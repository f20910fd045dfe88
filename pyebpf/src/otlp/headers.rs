//! Request headers (an API key, a tenant): never on the command line, where `ps` shows them, but
//! from `--otlp-headers-file` and the environment (`PYEBPF_OTLP_HEADERS`, else
//! `OTEL_EXPORTER_OTLP_HEADERS`).

use std::io::Read;
use std::path::Path;

use http::{HeaderName, HeaderValue};

use super::OtlpError;

/// The variables headers are read from, the first one set winning.
const HEADER_VARIABLES: [&str; 2] = ["PYEBPF_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"];

/// The largest headers file read.
const MAX_HEADERS_FILE: u64 = 64 * 1024;

/// Headers gRPC and HTTP set themselves: given ones would break the request.
const RESERVED: [&str; 7] = ["content-type", "content-encoding", "content-length", "te", "host", "grpc-encoding", "grpc-accept-encoding"];

/// Header names and values, checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(pub Vec<(HeaderName, HeaderValue)>);

impl Headers {
    /// The file's headers (if one is given) followed by the environment's.
    pub fn load(file: Option<&Path>) -> Result<Headers, OtlpError> {
        let mut headers = Headers::default();
        if let Some(path) = file {
            let mut text = String::new();
            let read = std::fs::File::open(path).and_then(|file| file.take(MAX_HEADERS_FILE).read_to_string(&mut text));
            read.map_err(|cause| OtlpError::Read { path: path.to_path_buf(), cause })?;
            headers.0.extend(parse_file(&text).map_err(|reason| OtlpError::Headers { source_name: path.display().to_string(), reason })?);
        }
        let variable = HEADER_VARIABLES.iter().find_map(|name| std::env::var(name).ok().map(|value| (name, value)));
        if let Some((name, value)) = variable {
            headers.0.extend(parse_variable(&value).map_err(|reason| OtlpError::Headers { source_name: name.to_string(), reason })?);
        }
        Ok(headers)
    }
}

/// `name: value` lines; blank lines and `#` comments are skipped.
pub(super) fn parse_file(text: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
    let mut headers = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, value) = line.split_once(':').ok_or_else(|| format!("line {}: expected `name: value`", number + 1))?;
        headers.push(header(name, value).map_err(|reason| format!("line {}: {reason}", number + 1))?);
    }
    Ok(headers)
}

/// `name=value,name=value`, values percent-decoded (the syntax of OTEL_EXPORTER_OTLP_HEADERS).
pub(super) fn parse_variable(text: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
    let mut headers = Vec::new();
    for (number, pair) in text.split(',').enumerate() {
        if pair.trim().is_empty() {
            continue;
        }
        let (name, value) = pair.split_once('=').ok_or_else(|| format!("entry {}: expected `name=value`", number + 1))?;
        let value = percent_decode(value.trim()).ok_or_else(|| format!("entry {}: bad percent-encoding", number + 1))?;
        headers.push(header(name, &value).map_err(|reason| format!("entry {}: {reason}", number + 1))?);
    }
    Ok(headers)
}

fn header(name: &str, value: &str) -> Result<(HeaderName, HeaderValue), String> {
    let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| format!("{:?} is not a header name", name.trim()))?;
    if RESERVED.contains(&name.as_str()) || name.as_str().starts_with("grpc-") {
        return Err(format!("{name} is set by pyebpf itself"));
    }
    // Values are secrets: never shown in an error.
    let value = HeaderValue::from_str(value.trim()).map_err(|_| format!("the value of {name} is not a valid header value"))?;
    Ok((name, value))
}

/// `%XX` escapes decoded; None for a broken escape or a result that is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}
