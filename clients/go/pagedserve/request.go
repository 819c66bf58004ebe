package pagedserve

import (
	"encoding/json"
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
