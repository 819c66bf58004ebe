// Command pagedserve-quickstart is the README's Go example: stream a greedy chat completion and print it.
//
//	go run ./cmd/pagedserve-quickstart 127.0.0.1:50051
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/pagedserve/pagedserve/clients/go/pagedserve"
	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

func main() {
	address := "127.0.0.1:50051"
	if len(os.Args) > 1 {
		address = os.Args[1]
	}
	client, err := pagedserve.Dial(address, pagedserve.Config{Timeout: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	messages := []*pb.ChatMessage{pagedserve.User("What is the capital of France?")}
	req := pagedserve.ChatRequest(messages, pagedserve.Greedy(32))
	_, err = client.Stream(context.Background(), req, func(chunk *pb.TokenChunk) {
		fmt.Print(chunk.Text) // printed as each chunk arrives
	})
	if err != nil {
		log.Fatal(pagedserve.Describe(err)) // e.g. "INVALID_ARGUMENT: sampling_params.temperature must be >= 0, ..."
	}
	fmt.Println()
}
