#pragma once
// A rank's timeline file (core/trace_recorder.hpp) read back line by line:
// the writer puts one event on each line, which is all the tests need to
// count and compare events without a JSON parser (test/trace/trace_test.py
// parses the files as JSON).

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace test {

struct TraceLine {
  std::string ph, name, cat;
  int pid = -1;
  unsigned tid = 0;
  double ts = 0, dur = 0;
  std::string line;
};

struct TraceFile {
  std::string text;
  std::vector<TraceLine> events;               ///< "X" events, in file order
  std::map<unsigned, std::string> thread_names;  ///< tid -> its "thread_name"
};

/// The value of `"key": ` on `line` (a string without its quotes); empty if absent.
inline std::string trace_field(const std::string& line, const std::string& key) {
  const std::string k = "\"" + key + "\": ";
  const auto at = line.find(k);
  if (at == std::string::npos) return {};
  std::size_t i = at + k.size();
  if (i < line.size() && line[i] == '"') {
    std::string v;
    for (++i; i < line.size() && line[i] != '"'; ++i) v += line[i] == '\\' ? line[++i] : line[i];
    return v;
  }
  const auto end = line.find_first_of(",}", i);
  return line.substr(i, end - i);
}

inline TraceFile read_trace(const std::filesystem::path& p) {
  TraceFile f;
  std::ifstream in(p);
  f.text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::size_t from = 0;
  while (from < f.text.size()) {
    std::size_t to = f.text.find('\n', from);
    if (to == std::string::npos) to = f.text.size();
    const std::string line = f.text.substr(from, to - from);
    from = to + 1;
    const std::string ph = trace_field(line, "ph");
    if (ph == "M" && trace_field(line, "name") == "thread_name") {
      const auto args = line.find("\"args\"");
      f.thread_names[static_cast<unsigned>(std::stoul(trace_field(line, "tid")))] =
          trace_field(line.substr(args), "name");
    }
    if (ph != "X") continue;
    TraceLine e;
    e.ph = ph;
    e.name = trace_field(line, "name");
    e.cat = trace_field(line, "cat");
    e.pid = std::stoi(trace_field(line, "pid"));
    e.tid = static_cast<unsigned>(std::stoul(trace_field(line, "tid")));
    e.ts = std::strtod(trace_field(line, "ts").c_str(), nullptr);
    e.dur = std::strtod(trace_field(line, "dur").c_str(), nullptr);
    e.line = line;
    f.events.push_back(e);
  }
  return f;
}

}  // namespace test
