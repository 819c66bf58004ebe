#!/usr/bin/env bash
# Builds the Go client offline against Debian 12's Go packages (golang-go 1.19, grpc-go 1.33.3,
# google.golang.org/protobuf 1.28.1 under /usr/share/gocode) in GOPATH mode, so that no module
# proxy is needed. Output: OUT/bin/pagedserve-generate (the streaming example) and
# OUT/bin/pagedserve-quickstart (the README example); OUT defaults to build/go at the repo root.
#
#     clients/go/build.sh [OUT]
#
# Online, module mode works as usual instead: `cd clients/go && go mod tidy && go build ./...`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${1:-$here/../../build/go}" && cd "${1:-$here/../../build/go}" && pwd)
src=$out/gopath/src/github.com/pagedserve/pagedserve/clients
mkdir -p "$src" "$out/bin"
ln -sfn "$here" "$src/go"
export GO111MODULE=off GOPATH="$out/gopath:/usr/share/gocode" GOPROXY=off GOFLAGS= CGO_ENABLED=0  # (no C compiler needed)
if [ -z "${GOCACHE:-}" ] && [ -z "${HOME:-}" ]; then
    export GOCACHE=$out/cache  # (Go's default cache lives under $HOME)
fi
cd "$src/go"
gofmt_out=$(gofmt -l pagedserve cmd)
if [ -n "$gofmt_out" ]; then
    echo "gofmt: not formatted: $gofmt_out" >&2
    exit 1
fi
go vet ./pagedserve/... ./cmd/...
go test ./pagedserve/...
go build -o "$out/bin/" ./cmd/...
echo "go: built $out/bin/pagedserve-generate and $out/bin/pagedserve-quickstart"
