#!/usr/bin/env bash
# Build a real OpenTelemetry Collector (core v0.152 from Debian sid's golang-opentelemetry-collector-dev)
# with the OTLP receiver (profiles too) and the debug, nop, otlp and otlphttp exporters, offline: no GitHub,
# no Go module proxy, only Debian's packaged Go toolchain and Go sources, built in GOPATH mode as
# Debian's own packages are. Cold: ~217 packages (~260 MB), ~2 GB extracted, ~5-6 min on 2 cores;
# warm: seconds. Result: a static ~30 MB binary. Profiles need --feature-gates=+service.profilesSupport.
#
#   OTELCOL_PREFIX=/some/dir ./build-otelcol.sh
#
# Env:
#   OTELCOL_PREFIX  install prefix (default ${XDG_CACHE_HOME:-$HOME/.cache}/pyebpf-otelcol). Layout:
#                     debs/      downloaded .deb files (cache)
#                     sysroot/   dpkg -x of Go toolchain + golang-*-dev sources
#                     src/otelcol-profiles/  main.go + components.go
#                     gocache/   Go build cache
#                     bin/otelcol-profiles   the collector
#   APT_DIR         private apt state with a sid sources.list (default $OTELCOL_PREFIX/apt; made if missing)
#   GO_SERIES       Debian Go series to use (default: 1.27, falls back to 1.26)
#
# Idempotent: already-downloaded debs, already-extracted debs and the Go build
# cache are reused. Every CPU/IO-heavy step runs under nice -n 19 ionice -c3.
# The system's apt configuration is never touched.
# `cargo xtask setup` runs it (xtask/src/otelcol.rs) when the collector is missing.
# (profiles need --feature-gates=+service.profilesSupport at run time).
set -euo pipefail

PREFIX=${OTELCOL_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/pyebpf-otelcol}
W=${APT_DIR:-$PREFIX/apt}
GO_SERIES=${GO_SERIES:-}
DEBS=$PREFIX/debs
SYSROOT=$PREFIX/sysroot
SRC=$PREFIX/src/otelcol-profiles
BIN=$PREFIX/bin/otelcol-profiles
LOW=(nice -n 19 ionice -c3)
mkdir -p "$DEBS" "$SYSROOT/.extracted" "$SRC" "$PREFIX/bin" "$PREFIX/gocache"

t0=$SECONDS
ts() { printf '[%4ds] %s\n' $((SECONDS - t0)) "$*"; }

# ---------------------------------------------------------------- private apt
APTOPTS=(-o Dir::Etc::SourceList="$W/sources.list" -o Dir::Etc::SourceParts=/dev/null
         -o Dir::State::Lists="$W/lists" -o Dir::Cache="$W/cache"
         -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
         -o APT::Sandbox::User=root)
APT=(apt-get -q "${APTOPTS[@]}")
APTC=(apt-cache "${APTOPTS[@]}")
# The Debian archive this machine's apt already uses (its sid suite is read through a private list).
MIRROR=${MIRROR:-$( { sed -nE 's/^(URIs:[[:space:]]*|deb[[:space:]]+(\[[^]]*\][[:space:]]+)?)(https?:[^[:space:]]*\/debian)\/?([[:space:]].*)?$/\3/p' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true; } | head -1)}
[ -n "$MIRROR" ] || { echo "no Debian archive found in /etc/apt: set MIRROR" >&2; exit 1; }
if [ ! -f "$W/sources.list" ]; then
  mkdir -p "$W/lists/partial" "$W/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR sid main" > "$W/sources.list"
fi
if ! ls "$W"/lists/*_Packages* >/dev/null 2>&1; then
  ts "apt-get update (private sid lists in $W)"
  "${LOW[@]}" "${APT[@]}" update
fi

# ------------------------------------------------------------- Go toolchain
if [ -z "$GO_SERIES" ]; then
  for s in 1.27 1.26; do
    if "${APTC[@]}" show "golang-$s-go" >/dev/null 2>&1; then GO_SERIES=$s; break; fi
  done
fi
[ -n "$GO_SERIES" ] || { echo "no golang-1.27/1.26 in $W" >&2; exit 1; }
ts "Go series: $GO_SERIES"

# ----------------------------------------------- package list (Go + closure)
COLLECTOR_DEB=${COLLECTOR_DEB:-}
PKGS=$("${APTC[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
         --no-breaks --no-replaces --no-enhances golang-opentelemetry-collector-dev \
       | grep -E '^golang-[^ ]*-dev$' | grep -vx golang-opentelemetry-collector-dev | sort -u)
PKGS="golang-$GO_SERIES-go golang-$GO_SERIES-src $PKGS"
[ -n "$COLLECTOR_DEB" ] || PKGS="$PKGS golang-opentelemetry-collector-dev"
ts "$(echo $PKGS | wc -w) packages to fetch/extract (+ local collector deb: ${COLLECTOR_DEB:-none})"

# ----------------------------------------------------------------- download
missing=()
# expected local name as written by 'apt-get download': PKG_VERSION_ARCH.deb, epoch ':' -> '%3a'
FILES=$("${APTC[@]}" show --no-all-versions $PKGS | awk '/^Package:/{p=$2} /^Version:/{v=$2; sub(":", "%3a", v)} /^Architecture:/{print p, p "_" v "_" $2 ".deb"}')
[ "$(wc -l <<<"$FILES")" -eq "$(echo $PKGS | wc -w)" ] || { echo "could not resolve all packages" >&2; exit 1; }
while read -r p f; do
  [ -s "$DEBS/$f" ] || missing+=("$p")
done <<<"$FILES"
if [ ${#missing[@]} -gt 0 ]; then
  ts "downloading ${#missing[@]} debs into $DEBS"
  (cd "$DEBS" && "${LOW[@]}" "${APT[@]}" download "${missing[@]}")
fi
[ -z "$COLLECTOR_DEB" ] || cp -u "$COLLECTOR_DEB" "$DEBS/"
ts "downloads done ($(du -sh "$DEBS" | cut -f1) in $DEBS)"

# ------------------------------------------------------------------ extract
n=0
for d in "$DEBS"/*.deb; do
  stamp=$SYSROOT/.extracted/$(basename "$d")
  [ -e "$stamp" ] && continue
  "${LOW[@]}" dpkg -x "$d" "$SYSROOT"
  touch "$stamp"; n=$((n + 1))
done
ts "extracted $n new debs ($(du -sh "$SYSROOT" | cut -f1) in $SYSROOT)"

GOROOT=$SYSROOT/usr/lib/go-$GO_SERIES
export PATH=$GOROOT/bin:$PATH GOROOT
"$GOROOT/bin/go" version

# ---------------------------------------------------------- collector source
write_if_changed() { # $1=file, content on stdin
  local tmp; tmp=$(mktemp); cat > "$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; fi
}
COLVER=$(grep -m1 -o '[0-9][0-9.]*-[0-9]*' <<<"$(ls "$DEBS"/golang-opentelemetry-collector-dev_*.deb | sort -V | tail -1 | xargs basename)")
write_if_changed "$SRC/main.go" <<EOF
// Minimal OpenTelemetry Collector distribution (ocb-style) built from
// Debian's golang-opentelemetry-collector-dev sources.
// Profiles need: --feature-gates=+service.profilesSupport
package main

import (
	"log"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/confmap/provider/httpprovider"
	"go.opentelemetry.io/collector/confmap/provider/httpsprovider"
	"go.opentelemetry.io/collector/confmap/provider/yamlprovider"
	"go.opentelemetry.io/collector/otelcol"
)

const debianCollectorVersion = "$COLVER"

func main() {
	info := component.BuildInfo{
		Command:     "otelcol-profiles",
		Description: "Minimal OpenTelemetry Collector (Debian sources) with OTLP profiles",
		Version:     debianCollectorVersion + "-debian",
	}
	set := otelcol.CollectorSettings{
		BuildInfo: info,
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(),
					fileprovider.NewFactory(),
					httpprovider.NewFactory(),
					httpsprovider.NewFactory(),
					yamlprovider.NewFactory(),
				},
			},
		},
	}
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		log.Fatalf("collector server run finished with error: %v", err)
	}
}
EOF
write_if_changed "$SRC/components.go" <<'EOF'
package main

import (
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/connector"
	"go.opentelemetry.io/collector/connector/forwardconnector"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/debugexporter"
	"go.opentelemetry.io/collector/exporter/nopexporter"
	"go.opentelemetry.io/collector/exporter/otlpexporter"
	"go.opentelemetry.io/collector/exporter/otlphttpexporter"
	"go.opentelemetry.io/collector/extension"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/processor/batchprocessor"
	"go.opentelemetry.io/collector/processor/memorylimiterprocessor"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/nopreceiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

func components() (otelcol.Factories, error) {
	var err error
	factories := otelcol.Factories{Telemetry: otelconftelemetry.NewFactory()}

	if factories.Extensions, err = otelcol.MakeFactoryMap[extension.Factory](); err != nil {
		return otelcol.Factories{}, err
	}
	if factories.Receivers, err = otelcol.MakeFactoryMap[receiver.Factory](
		otlpreceiver.NewFactory(),
		nopreceiver.NewFactory(),
	); err != nil {
		return otelcol.Factories{}, err
	}
	if factories.Processors, err = otelcol.MakeFactoryMap[processor.Factory](
		batchprocessor.NewFactory(),
		memorylimiterprocessor.NewFactory(),
	); err != nil {
		return otelcol.Factories{}, err
	}
	if factories.Exporters, err = otelcol.MakeFactoryMap[exporter.Factory](
		debugexporter.NewFactory(),
		nopexporter.NewFactory(),
		otlpexporter.NewFactory(),
		otlphttpexporter.NewFactory(),
	); err != nil {
		return otelcol.Factories{}, err
	}
	if factories.Connectors, err = otelcol.MakeFactoryMap[connector.Factory](
		forwardconnector.NewFactory(),
	); err != nil {
		return otelcol.Factories{}, err
	}

	const mod = "go.opentelemetry.io/collector (Debian golang-opentelemetry-collector-dev)"
	factories.ReceiverModules = map[component.Type]string{}
	for t := range factories.Receivers {
		factories.ReceiverModules[t] = mod
	}
	factories.ProcessorModules = map[component.Type]string{}
	for t := range factories.Processors {
		factories.ProcessorModules[t] = mod
	}
	factories.ExporterModules = map[component.Type]string{}
	for t := range factories.Exporters {
		factories.ExporterModules[t] = mod
	}
	factories.ConnectorModules = map[component.Type]string{}
	for t := range factories.Connectors {
		factories.ConnectorModules[t] = mod
	}
	factories.ExtensionModules = map[component.Type]string{}
	return factories, nil
}
EOF

# -------------------------------------------- build (GOPATH mode, like dh-golang)
export GO111MODULE=off GOPATH=$SYSROOT/usr/share/gocode GOPROXY=off GOTOOLCHAIN=local \
       GOFLAGS= GOENV=off GOTELEMETRY=off GOCACHE=$PREFIX/gocache CGO_ENABLED=0
tb=$SECONDS
ts "go build (GOPATH mode, GO111MODULE=off) ..."
(cd "$SRC" && "${LOW[@]}" go build -trimpath -ldflags='-s -w' -o "$BIN.tmp" . && mv -f "$BIN.tmp" "$BIN")
ts "build took $((SECONDS - tb))s; binary $(du -h "$BIN" | cut -f1)"
"$BIN" --version
echo "$BIN"
