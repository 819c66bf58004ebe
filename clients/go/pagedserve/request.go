package pagedserve

import (
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
