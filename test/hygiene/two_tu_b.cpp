// The second translation unit: same headers, a different instantiation.
#include <gradsync/gradsync.hpp>

#include "two_tu_use.hpp"

int a_main();

static int b_main() { return use_library<gradsync::Native>(2.0f); }

int main()
{
    return a_main() + b_main();
}
