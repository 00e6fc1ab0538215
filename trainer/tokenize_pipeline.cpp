#include "trainer/tokenize_pipeline.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

namespace trainer {
namespace {

TokenizedChunk tokenize(const TextChunk& chunk, const Tokenizer& tokenizer) {
  TokenizedChunk out;
  out.seq = chunk.seq;
  out.pieces = chunk.pieces;
  for (const DocumentPiece& p : chunk.pieces) {
    out.token_begin.push_back(out.tokens.size());
    const std::vector<int32_t> t =
        tokenizer.encode_ordinary(std::string_view(chunk.text).substr(p.begin, p.size));
    out.tokens.insert(out.tokens.end(), t.begin(), t.end());
  }
  out.token_begin.push_back(out.tokens.size());
  return out;
}

}  // namespace

void run_tokenize_pipeline(DocumentReader& reader, const Tokenizer& tokenizer, int threads,
                           const std::function<void(const TokenizedChunk&)>& consume) {
  const int64_t max_in_flight = std::min<int64_t>(threads + 4, kMaxChunksInFlight);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TextChunk> queued;
  std::map<int64_t, TokenizedChunk> done;  // tokenized, waiting for the chunks before them
  int64_t read = 0, taken = 0;
  bool reading = true, stop = false;
  std::exception_ptr error;
  auto fail = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = e;
    stop = true;
    cv.notify_all();
  };

  std::thread reader_thread([&] {
    try {
      reader.run([&](TextChunk&& chunk) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || read - taken < max_in_flight; });
        if (stop) throw std::runtime_error("stopped");  // unwinds the reader; not reported
        queued.push_back(std::move(chunk));
        read++;
        cv.notify_all();
      });
    } catch (...) {
      fail(std::current_exception());
    }
    std::lock_guard<std::mutex> lock(mu);
    reading = false;
    cv.notify_all();
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; w++)
    workers.emplace_back([&] {
      for (;;) {
        TextChunk chunk;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return stop || !queued.empty() || !reading; });
          if (stop || queued.empty()) return;
          chunk = std::move(queued.front());
          queued.pop_front();
        }
        try {
          TokenizedChunk t = tokenize(chunk, tokenizer);
          std::lock_guard<std::mutex> lock(mu);
          done.emplace(t.seq, std::move(t));
          cv.notify_all();
        } catch (...) {
          fail(std::current_exception());
          return;
        }
      }
    });

  try {
    for (;;) {
      TokenizedChunk next;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || done.count(taken) || (!reading && taken == read); });
        if (stop || !done.count(taken)) break;
        next = std::move(done.at(taken));
        done.erase(taken);
      }
      consume(next);
      std::lock_guard<std::mutex> lock(mu);
      taken++;
      cv.notify_all();
    }
  } catch (...) {
    fail(std::current_exception());
  }
  reader_thread.join();
  for (auto& w : workers) w.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace trainer
