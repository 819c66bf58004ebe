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

func TestToolHelpersFillTheChatMessages(t *testing.T) {
	params := `{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}`
	weather := Tool("get_weather", "The weather of a city.", params)
	req := ChatRequest([]*pb.ChatMessage{User("Weather in Paris?")}, Greedy(64))
	WithParallelToolCalls(WithToolChoice(WithTools(req, weather), ToolChoiceFunction("get_weather")), false)
	c := req.GetChat()
	if len(c.Tools) != 1 || c.Tools[0].Name != "get_weather" || c.Tools[0].Parameters != params {
		t.Errorf("WithTools: %v", c.Tools)
	}
	if c.ToolChoice.GetMode() != pb.ToolChoice_MODE_FUNCTION || c.ToolChoice.GetFunctionName() != "get_weather" {
		t.Errorf("WithToolChoice: %v", c.ToolChoice)
	}
	if c.ParallelToolCalls == nil || *c.ParallelToolCalls {
		t.Errorf("WithParallelToolCalls: %v", c.ParallelToolCalls)
	}
	if ChatRequest([]*pb.ChatMessage{User("x")}, nil).GetChat().ParallelToolCalls != nil {
		t.Error("parallel_tool_calls set by default")
	}
	for choice, mode := range map[*pb.ToolChoice]pb.ToolChoice_Mode{
		ToolChoiceNone(): pb.ToolChoice_MODE_NONE, ToolChoiceAuto(): pb.ToolChoice_MODE_AUTO,
		ToolChoiceRequired(): pb.ToolChoice_MODE_REQUIRED,
	} {
		if choice.Mode != mode {
			t.Errorf("tool choice %v, want %v", choice.Mode, mode)
		}
	}
	of, err := ToolOf("f", "", map[string]any{"type": "object"})
	if err != nil || of.Parameters != `{"type":"object"}` {
		t.Errorf("ToolOf: %v %v", of, err)
	}
	// OpenAI's JSON, whole or the function part; the schema is kept as written (its order).
	for _, text := range []string{
		`{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"z": 1, "a": 2}}}`,
		`{"name": "get_weather", "description": "d", "parameters": {"z": 1, "a": 2}}`,
	} {
		tool, err := ToolFromJSON(text)
		if err != nil || tool.Name != "get_weather" || tool.Description != "d" || tool.Parameters != `{"z": 1, "a": 2}` {
			t.Errorf("ToolFromJSON(%s): %v %v", text, tool, err)
		}
	}
	if tool, err := ToolFromJSON(`{"name": "f", "parameters": null}`); err != nil || tool.Parameters != "" {
		t.Errorf("ToolFromJSON without parameters: %v %v", tool, err)
	}
	for _, bad := range []string{`{"description": "no name"}`, `[1]`, `{"name": 3}`, `{`} {
		if _, err := ToolFromJSON(bad); err == nil {
			t.Errorf("ToolFromJSON(%s) accepted", bad)
		}
	}
	// A conversation sending back a call and its result.
	call := &pb.ToolCall{Id: "call_1", Name: "get_weather", Arguments: `{"city":"Paris"}`}
	history := []*pb.ChatMessage{User("Weather in Paris?"), Assistant("", call), ToolResult("call_1", "sunny")}
	if history[1].Role != "assistant" || history[1].ToolCalls[0] != call || history[2].Role != "tool" || history[2].ToolCallId != "call_1" {
		t.Errorf("history: %v", history)
	}
	if got := (Completion{FinishReason: pb.FinishReason_FINISH_REASON_TOOL_CALLS}).FinishReasonName(); got != "tool_calls" {
		t.Errorf("FinishReasonName: %q", got)
	}
	defer func() {
		if r := recover(); r == nil {
			t.Error("WithTools on a text request did not panic")
		}
	}()
	WithTools(TextRequest("x", nil), weather)
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

func TestEmbedAndSamplingExtraHelpers(t *testing.T) {
	req, err := EmbedRequest("mean", false, TextInput("hi"), TokenInput([]uint32{1, 2}))
	if err != nil {
		t.Fatal(err)
	}
	if req.Pooling.PoolingType != pb.PoolingParams_POOLING_TYPE_MEAN || req.Pooling.GetNormalize() {
		t.Errorf("pooling: %v", req.Pooling)
	}
	if req.Inputs[0].GetText() != "hi" || len(req.Inputs[1].GetTokenIds().GetIds()) != 2 {
		t.Errorf("inputs: %v", req.Inputs)
	}
	if def, _ := EmbedRequest("", true); def.Pooling.PoolingType != pb.PoolingParams_POOLING_TYPE_UNSPECIFIED {
		t.Errorf("default pooling: %v", def.Pooling)
	}
	if _, err := EmbedRequest("max", true); err == nil {
		t.Error("EmbedRequest accepted pooling max")
	}
	params := WithTruncatePromptTokens(WithPromptLogprobs(WithMinTokens(Greedy(8), 2), 3), 100)
	if params.GetMinTokens() != 2 || params.GetPromptLogprobs() != 3 || params.GetTruncatePromptTokens() != 100 {
		t.Errorf("sampling extras: %v", params)
	}
}
