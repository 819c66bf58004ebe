// The Go client of pagedserve's public gRPC API: generated stubs (pagedservev1), a small typed
// client (pagedserve) and an example command (cmd/pagedserve-generate). CI builds it offline
// against Debian 12's packages (grpc-go 1.33.3, google.golang.org/protobuf 1.28.1) in GOPATH
// mode: see build.sh. With a module proxy, `go mod tidy && go build ./...` works as usual.
module github.com/pagedserve/pagedserve/clients/go

go 1.19

require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
