package pagedserve

import (
	"context"
	"fmt"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// poolingTypes names the Embed RPC's pooling types as the HTTP API does.
var poolingTypes = map[string]pb.PoolingParams_PoolingType{
	"last": pb.PoolingParams_POOLING_TYPE_LAST,
	"mean": pb.PoolingParams_POOLING_TYPE_MEAN,
	"cls":  pb.PoolingParams_POOLING_TYPE_CLS,
}

// TextInput is an Embed input given as text (tokenized by the server, no special tokens added).
func TextInput(text string) *pb.EmbedInput {
	return &pb.EmbedInput{Input: &pb.EmbedInput_Text{Text: text}}
}

// TokenInput is an Embed input given as token ids.
func TokenInput(ids []uint32) *pb.EmbedInput {
	return &pb.EmbedInput{Input: &pb.EmbedInput_TokenIds{TokenIds: &pb.TokenIds{Ids: ids}}}
}

// EmbedRequest asks for one embedding per input, pooled as `pooling` says ("last", "mean" or
// "cls"; "" for the server's default, the last token), L2-normalised unless normalize is false.
func EmbedRequest(pooling string, normalize bool, inputs ...*pb.EmbedInput) (*pb.EmbedRequest, error) {
	params := &pb.PoolingParams{Normalize: &normalize}
	if pooling != "" {
		kind, ok := poolingTypes[pooling]
		if !ok {
			return nil, fmt.Errorf("pooling must be last, mean or cls, got %q", pooling)
		}
		params.PoolingType = kind
	}
	return &pb.EmbedRequest{Inputs: inputs, Pooling: params}, nil
}

// Embed returns one vector per input of req, in input order, with the inputs' token count.
func (c *Client) Embed(ctx context.Context, req *pb.EmbedRequest) ([][]float32, uint32, error) {
	resp, err := unary(c, ctx, c.stub.Embed, req)
	if err != nil {
		return nil, 0, err
	}
	vectors := make([][]float32, len(resp.Embeddings))
	for _, e := range resp.Embeddings {
		if int(e.Index) < len(vectors) {
			vectors[e.Index] = e.Values
		}
	}
	return vectors, resp.Usage.GetPromptTokens(), nil
}

// WithMinTokens masks EOS and the stop token ids until n tokens were generated (vLLM's min_tokens).
func WithMinTokens(params *pb.SamplingParams, n uint32) *pb.SamplingParams {
	params.MinTokens = &n
	return params
}

// WithPromptLogprobs asks for each prompt token's logprob and the k most likely tokens there.
func WithPromptLogprobs(params *pb.SamplingParams, k uint32) *pb.SamplingParams {
	params.PromptLogprobs = &k
	return params
}

// WithTruncatePromptTokens keeps only the prompt's last n tokens (vLLM's truncate_prompt_tokens).
func WithTruncatePromptTokens(params *pb.SamplingParams, n uint32) *pb.SamplingParams {
	params.TruncatePromptTokens = &n
	return params
}
