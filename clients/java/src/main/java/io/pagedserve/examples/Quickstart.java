package io.pagedserve.examples;

import io.grpc.StatusRuntimeException;
import io.pagedserve.client.PagedServeClient;
import io.pagedserve.v1.GenerateRequest;
import java.time.Duration;
import java.util.List;

/** The README's Java example: stream a greedy chat completion and print it. */
public final class Quickstart {
  public static void main(String[] args) throws Exception {
    String address = args.length > 0 ? args[0] : "127.0.0.1:50051";
    try (PagedServeClient client =
        PagedServeClient.forAddress(address).timeout(Duration.ofMinutes(1)).build()) {
      GenerateRequest request =
          PagedServeClient.chatRequest(
              List.of(PagedServeClient.user("What is the capital of France?")), PagedServeClient.greedy(32));
      client.stream(request, chunk -> System.out.print(chunk.getText())); // as each chunk arrives
      System.out.println();
    } catch (StatusRuntimeException e) {
      System.err.println(PagedServeClient.describe(e)); // e.g. "UNAUTHENTICATED: missing or invalid API key ..."
      System.exit(1);
    }
  }
}
