package pagedserve

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// Greedy is sampling parameters for greedy decoding of at most maxTokens tokens.
func Greedy(maxTokens uint32) *pb.SamplingParams {
	return &pb.SamplingParams{MaxTokens: proto.Uint32(maxTokens), Temperature: proto.Float32(0)}
}

// Sampled is sampling parameters for sampling at temperature, at most maxTokens tokens.
func Sampled(maxTokens uint32, temperature float32) *pb.SamplingParams {
	return &pb.SamplingParams{MaxTokens: proto.Uint32(maxTokens), Temperature: proto.Float32(temperature)}
}

// Structured outputs: each With* helper sets the constraint oneof of params (replacing any
// constraint set before: a request has at most one) and returns params, so that they chain:
//
//	params := pagedserve.WithJSONSchema(pagedserve.Greedy(64), `{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}`)
//	params := pagedserve.WithChoice(pagedserve.Greedy(4), "yes", "no")
//
// The server checks the values (sizes, a compilable schema or grammar) and refuses a bad one
// with INVALID_ARGUMENT naming the field ("sampling_params.json_schema could not be compiled: ...").

// WithJSONSchema constrains the output to a JSON value valid under schema (a JSON Schema
// document, as JSON text).
func WithJSONSchema(params *pb.SamplingParams, schema string) *pb.SamplingParams {
	params.Constraint = &pb.SamplingParams_JsonSchema{JsonSchema: schema}
	return params
}

// WithJSONSchemaOf is WithJSONSchema for a schema given as a Go value (a struct or a map),
// marshalled with encoding/json. Properties are generated in the order the schema lists them,
// and encoding/json sorts a map's keys: give the schema as a struct or as JSON text
// (WithJSONSchema) to choose that order.
func WithJSONSchemaOf(params *pb.SamplingParams, schema any) (*pb.SamplingParams, error) {
	text, err := json.Marshal(schema)
	if err != nil {
		return nil, fmt.Errorf("pagedserve: json schema: %w", err)
	}
	return WithJSONSchema(params, string(text)), nil
}

// WithJSONObject constrains the output to any JSON object (OpenAI's response_format json_object).
func WithJSONObject(params *pb.SamplingParams) *pb.SamplingParams {
	params.Constraint = &pb.SamplingParams_JsonObject{JsonObject: true}
	return params
}

// WithRegex constrains the whole output to match a regular expression.
func WithRegex(params *pb.SamplingParams, pattern string) *pb.SamplingParams {
	params.Constraint = &pb.SamplingParams_Regex{Regex: pattern}
	return params
}

// WithChoice constrains the output to exactly one of choices (1 to 256 non-empty strings).
func WithChoice(params *pb.SamplingParams, choices ...string) *pb.SamplingParams {
	params.Constraint = &pb.SamplingParams_Choice{Choice: &pb.Choices{Choices: choices}}
	return params
}

// WithGrammar constrains the output to a sentence of an EBNF grammar (GBNF dialect, with a
// `root` rule).
func WithGrammar(params *pb.SamplingParams, grammar string) *pb.SamplingParams {
	params.Constraint = &pb.SamplingParams_Grammar{Grammar: grammar}
	return params
}

// TextRequest is a request for a plain-text prompt (no chat template).
func TextRequest(prompt string, params *pb.SamplingParams) *pb.GenerateRequest {
	return &pb.GenerateRequest{Prompt: &pb.GenerateRequest_Text{Text: prompt}, SamplingParams: params}
}

// ChatRequest is a request for a chat conversation (the model's chat template applied).
func ChatRequest(messages []*pb.ChatMessage, params *pb.SamplingParams) *pb.GenerateRequest {
	chat := &pb.ChatMessages{Messages: messages}
	return &pb.GenerateRequest{Prompt: &pb.GenerateRequest_Chat{Chat: chat}, SamplingParams: params}
}

// User is a chat message with role "user".
func User(content string) *pb.ChatMessage { return &pb.ChatMessage{Role: "user", Content: content} }

// Assistant is a chat message with role "assistant": an earlier answer, its text and the tool
// calls it made (a Completion's ToolCalls, sent back as they came).
func Assistant(content string, calls ...*pb.ToolCall) *pb.ChatMessage {
	return &pb.ChatMessage{Role: "assistant", Content: content, ToolCalls: calls}
}

// ToolResult is a chat message with role "tool": the result of the call whose id is callID.
func ToolResult(callID, content string) *pb.ChatMessage {
	return &pb.ChatMessage{Role: "tool", Content: content, ToolCallId: callID}
}

// Tool calling (chat requests only; docs/tool_calling.md): a request declares the functions the
// model may call with WithTools and says how it may call them with WithToolChoice; each
// Completion then carries the calls the model made (ToolCalls) and the text outside them
// (Content), and finishes with FINISH_REASON_TOOL_CALLS ("tool_calls") when it made one:
//
//	weather := pagedserve.Tool("get_weather", "The weather of a city.",
//		`{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}`)
//	req := pagedserve.ChatRequest([]*pb.ChatMessage{pagedserve.User("Weather in Paris?")}, pagedserve.Greedy(64))
//	pagedserve.WithToolChoice(pagedserve.WithTools(req, weather), pagedserve.ToolChoiceRequired())
//
// The helpers set fields of the request's ChatMessages and return req, so that they chain; they
// panic when req has no chat prompt (TextRequest), a programming error. The server checks the
// tools (names, sizes, compilable schemas) and refuses bad ones with INVALID_ARGUMENT naming
// the field ("prompt.chat.tools[0].name ...").

// Tool is a function the model may call: name (1 to 64 of a-z A-Z 0-9 _ -), what it does, and
// its arguments' JSON Schema as JSON text ("": any JSON object).
func Tool(name, description, parameters string) *pb.Tool {
	return &pb.Tool{Name: name, Description: description, Parameters: parameters}
}

// ToolOf is Tool for a parameters schema given as a Go value (a struct or a map), marshalled
// with encoding/json (which sorts a map's keys; see WithJSONSchemaOf).
func ToolOf(name, description string, parameters any) (*pb.Tool, error) {
	text, err := json.Marshal(parameters)
	if err != nil {
		return nil, fmt.Errorf("pagedserve: tool %s parameters: %w", name, err)
	}
	return Tool(name, description, string(text)), nil
}

// ToolFromJSON is a tool given as OpenAI's JSON: a function object {"name", "description",
// "parameters"} or the whole tool {"type": "function", "function": {...}}. The parameters schema
// is kept as written (its properties' order is the order they are generated in).
func ToolFromJSON(text string) (*pb.Tool, error) {
	var tool struct {
		Function *json.RawMessage `json:"function"`
	}
	if err := json.Unmarshal([]byte(text), &tool); err != nil {
		return nil, fmt.Errorf("pagedserve: tool: %w", err)
	}
	function := []byte(text)
	if tool.Function != nil {
		function = *tool.Function
	}
	var f struct {
		Name        *string         `json:"name"`
		Description string          `json:"description"`
		Parameters  json.RawMessage `json:"parameters"`
	}
	if err := json.Unmarshal(function, &f); err != nil {
		return nil, fmt.Errorf("pagedserve: tool: %w", err)
	}
	if f.Name == nil {
		return nil, errors.New(`pagedserve: tool: needs a "name" (OpenAI's {"type": "function", "function": {...}})`)
	}
	parameters := strings.TrimSpace(string(f.Parameters))
	if parameters == "null" {
		parameters = ""
	}
	return Tool(*f.Name, f.Description, parameters), nil
}

// ToolChoiceNone lets the model make no calls (the tools are not shown to it).
func ToolChoiceNone() *pb.ToolChoice { return &pb.ToolChoice{Mode: pb.ToolChoice_MODE_NONE} }

// ToolChoiceAuto lets the model decide (the default with tools); its calls are parsed from its
// output in its own format.
func ToolChoiceAuto() *pb.ToolChoice { return &pb.ToolChoice{Mode: pb.ToolChoice_MODE_AUTO} }

// ToolChoiceRequired forces at least one call (exactly one without parallel tool calls).
func ToolChoiceRequired() *pb.ToolChoice { return &pb.ToolChoice{Mode: pb.ToolChoice_MODE_REQUIRED} }

// ToolChoiceFunction forces one call of the function named name (one of the request's tools).
func ToolChoiceFunction(name string) *pb.ToolChoice {
	return &pb.ToolChoice{Mode: pb.ToolChoice_MODE_FUNCTION, FunctionName: name}
}

// chat is req's chat prompt; helper names the caller in the panic of a request without one.
func chat(req *pb.GenerateRequest, helper string) *pb.ChatMessages {
	c := req.GetChat()
	if c == nil {
		panic("pagedserve: " + helper + " needs a chat request (ChatRequest)")
	}
	return c
}

// WithTools adds tools to the functions a chat request's model may call (at most 128 in all).
func WithTools(req *pb.GenerateRequest, tools ...*pb.Tool) *pb.GenerateRequest {
	c := chat(req, "WithTools")
	c.Tools = append(c.Tools, tools...)
	return req
}

// WithToolChoice says whether and how the model may call the tools (nil: the server's default,
// auto with tools).
func WithToolChoice(req *pb.GenerateRequest, choice *pb.ToolChoice) *pb.GenerateRequest {
	chat(req, "WithToolChoice").ToolChoice = choice
	return req
}

// WithParallelToolCalls says whether one completion may make several calls (the server's
// default: true).
func WithParallelToolCalls(req *pb.GenerateRequest, parallel bool) *pb.GenerateRequest {
	chat(req, "WithParallelToolCalls").ParallelToolCalls = proto.Bool(parallel)
	return req
}

// FinishReasonName is the name the other clients give a finish reason: "stop", "length",
// "abort", "tool_calls", or "unknown".
func FinishReasonName(r pb.FinishReason) string {
	switch r {
	case pb.FinishReason_FINISH_REASON_STOP:
		return "stop"
	case pb.FinishReason_FINISH_REASON_LENGTH:
		return "length"
	case pb.FinishReason_FINISH_REASON_ABORT:
		return "abort"
	case pb.FinishReason_FINISH_REASON_TOOL_CALLS:
		return "tool_calls"
	}
	return "unknown"
}

// CodeName is a status code's canonical name as the other clients print it ("INVALID_ARGUMENT").
func CodeName(code codes.Code) string {
	// codes.Code's String() is CamelCase ("InvalidArgument"); the canonical names are upper snake.
	name := code.String()
	var b strings.Builder
	for i, r := range name {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	switch code {
	case codes.OK:
		return "OK"
	case codes.Canceled:
		return "CANCELLED"
	}
	return strings.ToUpper(b.String())
}

// Describe formats an error as "CODE: message" (the form the Python and Java clients print).
func Describe(err error) string {
	s := status.Convert(err)
	return fmt.Sprintf("%s: %s", CodeName(s.Code()), s.Message())
}
