package pagedserve

import (
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

func TestConstraintHelpersSetTheOneof(t *testing.T) {
	schema := `{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}`
	if got := WithJSONSchema(Greedy(8), schema).GetJsonSchema(); got != schema {
		t.Errorf("WithJSONSchema: %q", got)
	}
	type property struct {
		Type string `json:"type"`
	}
	of, err := WithJSONSchemaOf(Greedy(8), struct {
		Type       string              `json:"type"`
		Properties map[string]property `json:"properties"`
	}{"object", map[string]property{"age": {"integer"}}})
	if err != nil || of.GetJsonSchema() != `{"type":"object","properties":{"age":{"type":"integer"}}}` {
		t.Errorf("WithJSONSchemaOf: %q %v", of.GetJsonSchema(), err)
	}
	if _, err := WithJSONSchemaOf(Greedy(8), func() {}); err == nil {
		t.Error("WithJSONSchemaOf marshalled a func")
	}
	if !WithJSONObject(Greedy(8)).GetJsonObject() {
		t.Error("WithJSONObject")
	}
	if got := WithRegex(Greedy(8), "[0-9]+").GetRegex(); got != "[0-9]+" {
		t.Errorf("WithRegex: %q", got)
	}
	if got := WithGrammar(Greedy(8), `root ::= "a"`).GetGrammar(); got != `root ::= "a"` {
		t.Errorf("WithGrammar: %q", got)
	}
	// The last helper wins: a request carries at most one constraint.
	params := WithChoice(WithRegex(Greedy(8), "x"), "yes", "no")
	if got := params.GetChoice().GetChoices(); len(got) != 2 || got[0] != "yes" || got[1] != "no" || params.GetRegex() != "" {
		t.Errorf("WithChoice: %v (regex %q)", got, params.GetRegex())
	}
	// It survives the wire: the oneof is encoded and decoded.
	data, err := proto.Marshal(params)
	if err != nil {
		t.Fatal(err)
	}
	var back pb.SamplingParams
	if err := proto.Unmarshal(data, &back); err != nil || !proto.Equal(&back, params) {
		t.Errorf("round trip: %v %v", &back, err)
	}
}

func TestCodeNamesAreTheCanonicalOnes(t *testing.T) {
	want := map[codes.Code]string{
		codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
		codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
		codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
		codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
		codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
		codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED", codes.Internal: "INTERNAL",
		codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS", codes.Unauthenticated: "UNAUTHENTICATED",
	}
	for code, name := range want {
		if got := CodeName(code); got != name {
			t.Errorf("CodeName(%v) = %q, want %q", code, got, name)
		}
	}
	if got := Describe(status.Error(codes.InvalidArgument, "sampling_params.temperature must be >= 0")); got != "INVALID_ARGUMENT: sampling_params.temperature must be >= 0" {
		t.Errorf("Describe: %q", got)
	}
}

func TestRetryDelays(t *testing.T) {
	p := DefaultRetryPolicy
	p.Jitter = 0
	unavailable := status.Error(codes.Unavailable, "no data plane")
	for retry, want := range map[int]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 3: 400 * time.Millisecond} {
		if got, ok := p.Delay(retry, false, unavailable, nil); !ok || got != want {
			t.Errorf("retry %d: %v %v, want %v", retry, got, ok, want)
		}
	}
	if _, ok := p.Delay(4, false, unavailable, nil); ok {
		t.Error("a 5th attempt")
	}
	if _, ok := p.Delay(1, true, unavailable, nil); ok {
		t.Error("a retry after the first response")
	}
	for i := 0; i < 100; i++ {
		if got, _ := DefaultRetryPolicy.Delay(1, false, unavailable, nil); got < 80*time.Millisecond || got > 100*time.Millisecond {
			t.Fatalf("jitter out of bounds: %v", got)
		}
	}
	exhausted := status.Error(codes.ResourceExhausted, "queue full")
	if got, ok := p.Delay(1, false, exhausted, metadata.Pairs("retry-after", "1.5")); !ok || got != 1500*time.Millisecond {
		t.Errorf("retry-after 1.5: %v %v", got, ok)
	}
	for _, md := range []metadata.MD{nil, metadata.Pairs("retry-after", "soon"), metadata.Pairs("retry-after", "31")} {
		if _, ok := p.Delay(1, false, exhausted, md); ok {
			t.Errorf("retried RESOURCE_EXHAUSTED with %v", md)
		}
	}
	for _, err := range []error{status.Error(codes.InvalidArgument, ""), status.Error(codes.DeadlineExceeded, ""), errors.New("x")} {
		if _, ok := p.Delay(1, false, err, metadata.Pairs("retry-after", "1")); ok {
			t.Errorf("retried %v", err)
		}
	}
	if _, ok := NoRetry.Delay(1, false, unavailable, nil); ok {
		t.Error("NoRetry retried")
	}
}
